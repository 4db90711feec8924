"""The ROCm platform: a HIP build of torch (device type "cuda" in torch), Triton kernels from podium-cuda."""

from __future__ import annotations

import torch

from podium_cuda.platform import CudaPlatform
from podium_plugin_api import Availability, Capabilities


def rocm_availability() -> Availability:
    hip = getattr(torch.version, "hip", None)
    if not hip:
        return Availability(False, f"torch {torch.__version__} is not a ROCm/HIP build")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return Availability(False, f"torch {torch.__version__} (HIP {hip}) sees no AMD GPU")
    return Availability(True, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (HIP {hip})")


class RocmPlatform(CudaPlatform):
    name = "rocm"
    device_type = "cuda"  # torch addresses HIP devices as "cuda"
    priority = 100

    def availability(self) -> Availability:
        return rocm_availability()

    def capabilities(self) -> Capabilities:
        base = super().capabilities()
        return Capabilities(
            dtypes=base.dtypes,
            default_dtype=base.default_dtype,
            graph_capture=True,
            fp8="e4m3fnuz",
            distributed_backend="nccl",  # RCCL answers to the nccl backend name
            pinned_memory=True,
            kv_cache_from_free_memory=True,
        )
