"""What this CPU offers the engine: native bfloat16 arithmetic, and how many cores we may use.

Native bf16 means the CPU computes with bf16 (AVX512_BF16 dot products or AMX tiles), so bf16
matmuls run at least as fast as fp32 ones on half the memory traffic; without it bf16 is emulated
and slower than fp32, so fp32 is the better default there.

Cores: the physical cores among the CPUs this process may run on (``os.sched_getaffinity``;
hyperthread siblings count once), capped by the cgroup CPU quota (v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) where a container sets one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def has_native_bf16(flags: set[str] | None = None) -> bool:
    """True where the CPU computes in bf16 natively (AVX512_BF16 or AMX-BF16) and torch uses it."""
    flags = cpu_flags() if flags is None else flags
    if not any(f in flags for f in NATIVE_BF16_FLAGS):
        return False
    return torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")


def physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Distinct (package, core) pairs among ``cpus``; ``len(cpus)`` where the topology is unreadable."""
    cores = set()
    for cpu in cpus:
        topo = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(), topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of quota the cgroup grants (e.g. 1.5), or None when unlimited or unknown."""
    try:
        quota, period = root.joinpath("cpu.max").read_text().split()[:2]  # v2: "max 100000" or "150000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for base in (root / "cpu", root / "cpu,cpuacct", root):  # v1
        try:
            quota = int(base.joinpath("cpu.cfs_quota_us").read_text())
            period = int(base.joinpath("cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else quota / period
    return None


def usable_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity; every CPU where the OS has none)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """Threads worth running: physical cores we may use, capped by the cgroup quota (>= 1)."""
    cores = physical_cores(usable_cpus())
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)
