"""Platform conformance outside attention: version, capabilities, device, memory, distributed."""

from __future__ import annotations

import torch

from ..platform import Capabilities, MemoryInfo, Platform
from ..version import API_VERSION, compatibility_problem
from .report import ConformanceError, dtype_name, guarded

# torch.distributed backends that live outside torch (registered by their runtimes when imported)
OUT_OF_TREE_BACKENDS = frozenset({"xla", "hccl", "cncl", "ccl", "xccl"})


def check_api_version(platform: Platform) -> None:
    problem = compatibility_problem(str(platform.api_version), API_VERSION)
    if problem:
        raise ConformanceError(f"Platform.api_version {platform.api_version!r}: {problem}")


def check_capabilities(platform: Platform) -> Capabilities:
    caps = guarded("capabilities()", platform.capabilities)
    if not isinstance(caps, Capabilities):
        raise ConformanceError(
            f"capabilities() returned {type(caps).__name__}, expected podium_plugin_api.Capabilities"
        )
    if not caps.dtypes or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in caps.dtypes):
        raise ConformanceError(
            f"capabilities().dtypes must be a non-empty tuple of floating torch dtypes, got {caps.dtypes!r}"
        )
    if caps.default_dtype not in caps.dtypes:
        raise ConformanceError(
            f"capabilities().default_dtype {dtype_name(caps.default_dtype)} is not among its dtypes "
            f"{[dtype_name(d) for d in caps.dtypes]}"
        )
    guarded("capabilities().as_dict() (printed by podium platforms --verbose)", caps.as_dict)
    return caps


def known_distributed_backends() -> set[str]:
    """torch.distributed backend names known in this process, plus well-known out-of-tree ones."""
    names = set(OUT_OF_TREE_BACKENDS)
    backend = getattr(getattr(torch, "distributed", None), "Backend", None)
    names.update(str(b).lower() for b in getattr(backend, "backend_list", ["gloo", "nccl", "mpi", "ucc"]))
    names.discard("undefined")
    return names


def check_distributed_backend(caps: Capabilities) -> None:
    name = caps.distributed_backend
    known = known_distributed_backends()
    if not isinstance(name, str) or name.lower() not in known:
        raise ConformanceError(
            f"capabilities().distributed_backend is {name!r}, not a torch.distributed backend known here "
            f"(known: {sorted(known)}); use your runtime's backend name and register it with "
            f"torch.distributed.Backend.register_backend before the core calls init_process_group"
        )


def check_device_and_memory(platform: Platform) -> None:
    count = guarded("device_count()", platform.device_count)
    if not isinstance(count, int) or count < 1:
        raise ConformanceError(f"device_count() is {count!r} on an available platform; expected an int >= 1")
    device = guarded("torch_device()", platform.torch_device)
    if not isinstance(device, torch.device) or device.type != platform.device_type:
        raise ConformanceError(
            f"torch_device() returned {device!r}; expected a torch.device of type {platform.device_type!r}"
        )
    guarded("set_device(0)", platform.set_device, 0)
    key = guarded("device_key(0)", platform.device_key, 0)
    if not isinstance(key, str) or not key or key != guarded("device_key(0)", platform.device_key, 0):
        raise ConformanceError(f"device_key(0) returned {key!r}; expected the same non-empty str on every call "
                               "(the hardware's identity, which a router groups co-located replicas by)")
    guarded("synchronize()", platform.synchronize)
    guarded("seed(0)", platform.seed, 0)
    info = guarded("memory_info()", platform.memory_info)
    if not isinstance(info, MemoryInfo):
        raise ConformanceError(f"memory_info() returned {type(info).__name__}, expected podium_plugin_api.MemoryInfo")
    free, total = info.free_bytes, info.total_bytes
    if not (isinstance(free, int) and isinstance(total, int) and 0 < free <= total):
        raise ConformanceError(
            f"memory_info() says free={free!r}, total={total!r} bytes; expected ints with 0 < free <= total"
        )
    guarded("reset_peak_memory()", platform.reset_peak_memory)
    peak = guarded("peak_memory()", platform.peak_memory)
    if not isinstance(peak, int) or peak < 0:
        raise ConformanceError(f"peak_memory() returned {peak!r}; expected an int >= 0 (0 where unknown)")
