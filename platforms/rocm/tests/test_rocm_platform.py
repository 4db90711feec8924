"""The ROCm platform without an AMD GPU: detection and selection on a simulated HIP build of torch,
the capabilities each architecture declares, and the test-only switch onto CUDA.

A HIP build is simulated the way it looks to Python: ``torch.version.hip`` set and torch.cuda
answering for an AMD device (``gcnArchName`` in its properties). The plugins are found through
their real entry points, as the engine finds them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import podium_rocm.detection as detection
from podium_plugin_api.discovery import load_plugins
from podium_plugin_api.testing.platform_checks import check_capabilities, check_distributed_backend
from podium_rocm import RocmPlatform
from podium_rocm.arch import TARGET_ARCH, parse_arch
from podium_rocm.platform import ROCM_BATCH_INVARIANT

HIP_VERSION = "6.4.43482-0f2d60242"


def fake_device(monkeypatch, *, name: str, count: int = 1, **properties) -> None:
    """torch.cuda answers as if ``count`` devices called ``name`` were present."""
    props = SimpleNamespace(name=name, **properties)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(detection, "triton_installed", lambda: True)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("PODIUM_DEVICE", raising=False)
    monkeypatch.delenv(detection.FORCE_ON_CUDA_ENV, raising=False)


@pytest.fixture
def hip_build(monkeypatch):
    """A ROCm build of torch; call the returned function to plug in AMD GPUs."""
    monkeypatch.setattr(torch.version, "hip", HIP_VERSION)
    monkeypatch.setattr(torch.version, "cuda", None)

    def plug(gcn_arch: str = "gfx942:sramecc+:xnack-", name: str = "AMD Instinct MI300X", count: int = 1, cus: int = 304):
        fake_device(monkeypatch, name=name, count=count, gcnArchName=gcn_arch, multi_processor_count=cus)

    return plug


def by_name(entries):
    return {e.name: e for e in entries}


# --- detection and selection ---------------------------------------------------------------------


def test_a_cpu_or_cuda_build_of_torch_is_not_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    availability = RocmPlatform().availability()
    assert not availability.ok
    assert "not a ROCm/HIP build" in availability.reason


def test_hip_build_with_an_mi300x_is_available_and_named(hip_build):
    hip_build(count=8)
    availability = RocmPlatform().availability()
    assert availability.ok, availability.reason
    assert availability.reason == f"8 x AMD Instinct MI300X (gfx942, HIP {HIP_VERSION})"


def test_selection_on_a_hip_build_picks_rocm_and_cuda_says_why_not(hip_build):
    hip_build()
    plugins = load_plugins()
    entries = by_name(plugins.platforms)
    assert entries["rocm"].availability.ok
    assert entries["cpu"].availability.ok  # so rocm wins on priority, not because it is alone
    assert entries["rocm"].platform.priority > entries["cpu"].platform.priority
    cuda = entries["cuda"].availability
    assert not cuda.ok and "ROCm/HIP build" in cuda.reason and "rocm" in cuda.reason
    assert plugins.select().name == "rocm"
    assert plugins.select("cpu").name == "cpu"


def test_hip_build_without_a_gpu_is_unavailable_and_cpu_is_selected(hip_build, monkeypatch):
    hip_build(count=0)
    plugins = load_plugins()
    rocm = by_name(plugins.platforms)["rocm"].availability
    assert not rocm.ok and "sees no AMD GPU" in rocm.reason and HIP_VERSION in rocm.reason
    assert plugins.select().name == "cpu"


def test_hip_build_without_triton_is_unavailable_with_the_fix(hip_build, monkeypatch):
    hip_build()
    monkeypatch.setattr(detection, "triton_installed", lambda: False)
    availability = RocmPlatform().availability()
    assert not availability.ok and "pytorch-triton-rocm" in availability.reason


# --- capabilities ----------------------------------------------------------------------------------


def test_mi300x_capabilities(hip_build):
    hip_build()
    caps = RocmPlatform().capabilities()
    check_capabilities(RocmPlatform())  # the conformance kit's own checks
    check_distributed_backend(caps)
    assert caps.fp8 == "e4m3fnuz"
    assert caps.distributed_backend == "nccl"
    assert caps.graph_capture and caps.kv_cache_from_free_memory and caps.pinned_memory
    assert caps.default_dtype == torch.bfloat16 and torch.bfloat16 in caps.dtypes
    assert caps.extra == {"gcn_arch": "gfx942", "wavefront_size": 64, "forced_on_cuda": False,
                          "batch_invariant": ROCM_BATCH_INVARIANT}
    assert not caps.batch_invariant  # podium-cuda's batch-invariant kernels are not checked on AMD GPUs


@pytest.mark.parametrize(
    "gcn_arch,fp8,wavefront",
    [
        ("gfx942:sramecc+:xnack-", "e4m3fnuz", 64),  # MI300X / MI325X
        ("gfx950:sramecc+:xnack-", "e4m3fn", 64),  # MI350: OCP fp8
        ("gfx90a:sramecc+:xnack-", None, 64),  # MI200: no fp8
        ("gfx1100", None, 32),  # RDNA3
        ("gfx1201", "e4m3fn", 32),  # RDNA4
    ],
)
def test_capabilities_follow_the_architecture(hip_build, gcn_arch, fp8, wavefront):
    hip_build(gcn_arch=gcn_arch)
    caps = RocmPlatform().capabilities()
    assert (caps.fp8, caps.extra["wavefront_size"], caps.extra["gcn_arch"]) == (fp8, wavefront, gcn_arch.split(":")[0])


def test_parse_arch():
    assert parse_arch(None) is None and parse_arch("") is None
    assert parse_arch("GFX942:sramecc+") == TARGET_ARCH
    unknown = parse_arch("gfx9999")
    assert (unknown.family, unknown.wavefront_size, unknown.fp8) == ("unknown", 64, None)
    assert parse_arch("gfx1030").family == "rdna" and not parse_arch("gfx1030").is_cdna
    assert parse_arch("gfx950").is_cdna


def test_tuning_follows_the_device(hip_build):
    hip_build(cus=228)  # MI300A
    assert RocmPlatform().tuning().split.target_programs == 2 * 228


def test_wave32_gpus_keep_128_threads_per_data_movement_program(hip_build):
    hip_build(gcn_arch="gfx1100", name="AMD Radeon RX 7900 XTX", cus=96)
    tuning = RocmPlatform().tuning()
    assert (tuning.kv_write_num_warps, tuning.reduce_num_warps, tuning.elementwise_num_warps) == (4, 4, 4)


# --- the test-only switch onto CUDA ----------------------------------------------------------------


@pytest.fixture
def cuda_build(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    fake_device(monkeypatch, name="NVIDIA H200", multi_processor_count=132, major=9)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


def test_switch_makes_rocm_available_on_a_cuda_device_and_says_so(cuda_build, monkeypatch):
    assert not RocmPlatform().availability().ok  # off: a CUDA device is not an AMD GPU
    monkeypatch.setenv(detection.FORCE_ON_CUDA_ENV, "1")
    platform = RocmPlatform()
    availability = platform.availability()
    assert availability.ok, availability.reason
    assert "forced onto CUDA for testing" in availability.reason and "NVIDIA H200" in availability.reason
    caps = platform.capabilities()
    assert caps.extra == {"gcn_arch": TARGET_ARCH.gfx, "wavefront_size": 64, "forced_on_cuda": True,
                          "batch_invariant": ROCM_BATCH_INVARIANT}
    assert caps.fp8 == "e4m3fnuz"  # the target architecture's, as on the MI300X it stands in for
    assert platform.tuning().split.target_programs == 2 * 132


@pytest.mark.parametrize("value", ["0", "true", ""])
def test_switch_is_only_the_value_1(cuda_build, monkeypatch, value):
    monkeypatch.setenv(detection.FORCE_ON_CUDA_ENV, value)
    assert not RocmPlatform().availability().ok


def test_switch_without_a_cuda_device_says_so(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    fake_device(monkeypatch, name="none", count=0)
    monkeypatch.setenv(detection.FORCE_ON_CUDA_ENV, "1")
    availability = RocmPlatform().availability()
    assert not availability.ok
    assert detection.FORCE_ON_CUDA_ENV in availability.reason and "sees none" in availability.reason


def test_switch_is_ignored_on_a_hip_build(hip_build, monkeypatch):
    hip_build(gcn_arch="gfx950", name="AMD Instinct MI355X", cus=256)
    monkeypatch.setenv(detection.FORCE_ON_CUDA_ENV, "1")
    platform = RocmPlatform()
    assert "forced" not in platform.availability().reason
    assert platform.capabilities().extra["gcn_arch"] == "gfx950"
    assert platform.capabilities().extra["forced_on_cuda"] is False
