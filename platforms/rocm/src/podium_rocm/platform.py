"""The ROCm platform: a HIP build of torch (device type "cuda" in torch), podium-cuda's Triton kernels.

Everything CUDA and HIP share comes from CudaPlatform through torch's HIP-backed ``torch.cuda``:
device selection, memory sizing (``mem_get_info``, peak-memory profiling, the KV cache sized from
free memory), HIP graphs (``torch.cuda.CUDAGraph`` is a hipGraph on ROCm: CudaGraphRunner captures
and replays them unchanged) and RCCL, which answers to torch.distributed's ``"nccl"`` backend.
What differs is declared, never branched on by the core: the launch parameters (tuning.py) and
the capabilities of the architecture (arch.py), e.g. the fp8 flavour ``e4m3fnuz`` on MI300.
"""

from __future__ import annotations

import torch

from podium_cuda.platform import CudaPlatform
from podium_cuda.tuning import KernelTuning
from podium_plugin_api import AttentionBackend, Availability, Capabilities

from .detection import RocmDevice, probe_device, rocm_availability
from .tuning import tuning_for

# podium-cuda's batch-invariant GEMM relies on a matrix unit whose row results ignore the other rows
# and the row's place in the tile, which benchmarks/invariant_gpu.sh checks on an NVIDIA GPU only
ROCM_BATCH_INVARIANT = ("not offered: podium-cuda's batch-invariant kernels are checked on NVIDIA GPUs "
                        "(benchmarks/invariant_gpu.sh), not yet on AMD matrix cores")


class RocmPlatform(CudaPlatform):
    name = "rocm"
    device_type = "cuda"  # torch addresses HIP devices as "cuda"
    priority = 100

    def __init__(self) -> None:
        super().__init__()
        self._device: RocmDevice | None = None

    def availability(self) -> Availability:
        return rocm_availability()

    def rocm_device(self) -> RocmDevice:
        """Device 0's architecture and compute units (read once; see detection.probe_device)."""
        if self._device is None:
            self._device = probe_device()
        return self._device

    def base_tuning(self) -> KernelTuning:
        """The launch table this platform gives podium-cuda's kernels (before the tuning option)."""
        return tuning_for(self.rocm_device())

    def capabilities(self) -> Capabilities:
        device = self.rocm_device()
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return Capabilities(
            dtypes=(torch.float32, torch.float16, torch.bfloat16) if bf16 else (torch.float32, torch.float16),
            default_dtype=torch.bfloat16 if bf16 else torch.float16,
            graph_capture=True,  # HIP graphs through torch.cuda.CUDAGraph
            fp8=device.arch.fp8,  # "e4m3fnuz" on CDNA3 (MI300), "e4m3fn" on CDNA4/RDNA4, None before
            distributed_backend="nccl",  # RCCL registers under torch.distributed's nccl name
            pinned_memory=True,
            kv_cache_from_free_memory=True,
            extra={
                "gcn_arch": device.arch.gfx,
                "wavefront_size": device.arch.wavefront_size,
                "forced_on_cuda": device.forced_on_cuda,
                "batch_invariant": ROCM_BATCH_INVARIANT,
            },
        )

    def use_batch_invariant_kernels(self) -> None:
        raise NotImplementedError(f"platform 'rocm' has no batch-invariant mode: {ROCM_BATCH_INVARIANT}")

    def _new_backend(self) -> AttentionBackend:
        from .attention import RocmAttentionBackend  # triton is imported here, not before

        return RocmAttentionBackend(tuning=self.tuning())
