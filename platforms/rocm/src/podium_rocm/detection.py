"""Is this a ROCm machine, and which AMD GPU is it? Plus the test-only switch onto CUDA.

A ROCm build of torch reports ``torch.version.hip`` and addresses AMD GPUs as ``"cuda"`` devices,
so the HIP runtime answers torch.cuda's calls (device count, memory, graphs). Nothing here
imports triton; it only checks that triton is installed (ROCm torch wheels bring it as
pytorch-triton-rocm).

Test-only switch: ``PODIUM_ROCM_FORCE_ON_CUDA=1`` on a CUDA build of torch makes this platform
available on the NVIDIA GPU, running its own code path there (the ROCm tuning table, its graph
capture and kernels, with the capabilities of ``arch.TARGET_ARCH``). It exists so the ROCm path is
proven on the hardware we have; it is read here and nowhere else, is ignored on a HIP build, and
is not a setting for serving (the cuda platform is the one to serve NVIDIA GPUs with).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from podium_plugin_api import Availability

from .arch import TARGET_ARCH, AmdArch, parse_arch

FORCE_ON_CUDA_ENV = "PODIUM_ROCM_FORCE_ON_CUDA"
TRITON_MISSING = "triton is not installed (ROCm builds of torch bring it as pytorch-triton-rocm)"


@dataclass(frozen=True)
class RocmDevice:
    """Device 0 as the platform sees it.

    compute_units: CUs (SMs when forced onto CUDA), None where unknown.
    forced_on_cuda: an NVIDIA GPU stands in for an AMD one (test-only switch); ``arch`` is then TARGET_ARCH.
    """

    arch: AmdArch
    compute_units: int | None
    name: str
    forced_on_cuda: bool


def forced_on_cuda() -> bool:
    """The test-only switch is on: ``PODIUM_ROCM_FORCE_ON_CUDA=1`` and torch is not a HIP build."""
    return os.environ.get(FORCE_ON_CUDA_ENV) == "1" and not getattr(torch.version, "hip", None)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _sees_device() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _device_properties() -> Any | None:
    """torch.cuda.get_device_properties(0), or None where no device answers."""
    if not _sees_device():
        return None
    try:
        return torch.cuda.get_device_properties(0)
    except (RuntimeError, AssertionError):  # torch's "no device" / "not compiled with CUDA" errors
        return None


def probe_device() -> RocmDevice:
    """Device 0's architecture, compute units and name (TARGET_ARCH when forced or unreadable)."""
    props = _device_properties()
    forced = forced_on_cuda()
    arch = None if forced else parse_arch(getattr(props, "gcnArchName", None))
    units = getattr(props, "multi_processor_count", None)  # HIP reports compute units here
    return RocmDevice(
        arch=arch or TARGET_ARCH,
        compute_units=units if isinstance(units, int) and units > 0 else None,
        name=str(getattr(props, "name", "")),
        forced_on_cuda=forced,
    )


def _forced_availability() -> Availability:
    if not torch.version.cuda or not _sees_device():
        return Availability(
            False,
            f"{FORCE_ON_CUDA_ENV}=1 (test-only) forces the rocm platform onto a CUDA device, "
            f"but torch {torch.__version__} sees none",
        )
    if not triton_installed():
        return Availability(False, TRITON_MISSING)
    return Availability(
        True,
        f"forced onto CUDA for testing ({FORCE_ON_CUDA_ENV}=1, test-only): {torch.cuda.device_count()} x "
        f"{torch.cuda.get_device_name(0)} runs the rocm platform's {TARGET_ARCH.gfx} tuning, graph capture and kernels",
    )


def rocm_availability() -> Availability:
    """Available on a HIP build of torch that sees an AMD GPU, with triton installed; else why not."""
    if forced_on_cuda():
        return _forced_availability()
    hip = getattr(torch.version, "hip", None)
    if not hip:
        return Availability(
            False,
            f"torch {torch.__version__} is not a ROCm/HIP build (torch.version.hip is None); "
            f"install torch from a ROCm wheel index",
        )
    if not _sees_device():
        return Availability(
            False,
            f"torch {torch.__version__} (HIP {hip}) sees no AMD GPU; check access to /dev/kfd and /dev/dri "
            f"and HIP_VISIBLE_DEVICES",
        )
    if not triton_installed():
        return Availability(False, TRITON_MISSING)
    device = probe_device()
    return Availability(
        True, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} ({device.arch.gfx}, HIP {hip})"
    )
