"""The CPU platform's machine facts (bf16 support, cores, cgroup quota) and native-kernel builds."""

from __future__ import annotations

import os
import time

import torch

from podium_cpu import CpuPlatform, cpu_info, native_kernels

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx512f {extra}\nprocessor\t: 1\n"


def test_native_bf16_needs_the_cpu_flag():
    assert not cpu_info.has_native_bf16(cpu_info.cpu_flags(CPUINFO.format(extra="avx2")))
    flags = cpu_info.cpu_flags(CPUINFO.format(extra="avx512_bf16"))
    assert "avx512_bf16" in flags
    capable = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
    assert cpu_info.has_native_bf16(flags) == capable
    assert cpu_info.has_native_bf16(cpu_info.cpu_flags(CPUINFO.format(extra="amx_bf16 amx_tile"))) == capable


def test_default_dtype_follows_the_cpu():
    caps = CpuPlatform().capabilities()
    want = torch.bfloat16 if cpu_info.has_native_bf16() else torch.float32
    assert caps.default_dtype == want and want in caps.dtypes and torch.float32 in caps.dtypes
    assert CpuPlatform().capabilities() == caps


def _topology(root, cpu, package, core):
    topo = root / f"cpu{cpu}" / "topology"
    topo.mkdir(parents=True)
    (topo / "physical_package_id").write_text(f"{package}\n")
    (topo / "core_id").write_text(f"{core}\n")


def test_hyperthread_siblings_count_once(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1), (1, 0)]):
        _topology(tmp_path, cpu, package, core)
    assert cpu_info.physical_cores({0, 1, 2, 3, 4}, tmp_path) == 3
    assert cpu_info.physical_cores({0, 2}, tmp_path) == 1  # an affinity mask of two siblings
    assert cpu_info.physical_cores({7}, tmp_path) == 1  # unreadable topology: count CPUs


def test_cgroup_quota(tmp_path):
    assert cpu_info.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_info.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_info.cgroup_cpu_limit(tmp_path) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_info.cgroup_cpu_limit(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cpu_info.cgroup_cpu_limit(v1) == 3.0


def test_set_device_caps_threads_at_usable_cores():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cpu_info.usable_cores() + 3)
        CpuPlatform().set_device(0)
        assert torch.get_num_threads() == cpu_info.usable_cores()
        torch.set_num_threads(1)
        CpuPlatform().set_device(0)
        assert torch.get_num_threads() == 1  # a count the user lowered stays
    finally:
        torch.set_num_threads(before)


def test_kernels_build_into_the_cache_and_replace_stale_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native_kernels, "_LOADED", {})
    stale = tmp_path / "podium" / "cpu-kernels" / "fused_ops-0000000000000000.so"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old build")
    long_ago = time.time() - native_kernels.STALE_AFTER_S - 60  # a recent build may be another checkout's
    os.utime(stale, (long_ago, long_ago))
    kernels, why = native_kernels.load_kernels()
    if kernels is None:
        assert "compiler" in why or "unavailable" in why
        return
    assert sorted(p.name.split("-")[0] for p in kernels.paths) == ["amx_linear", "dpbf16_linear", "fma_linear",
                                                                         "fused_ops", "gguf_linear", "graph_replay",
                                                                         "paged_attention"]
    assert all(p.parent == stale.parent and p.exists() for p in kernels.paths)
    assert not stale.exists()


def test_no_compiler_is_reported_not_fatal(monkeypatch):
    monkeypatch.setattr(native_kernels, "COMPILERS", ("no-such-compiler-podium",))
    monkeypatch.setattr(native_kernels, "_LOADED", {})
    kernels, why = native_kernels.load_kernels()
    assert kernels is None and "no C compiler" in why
