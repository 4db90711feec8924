"""RocmAttentionBackend: podium-cuda's Triton attention launched with the ROCm tuning table.

Imported only when the platform is asked for its backend (this imports triton). The cache layout,
the kernels and the graph-capture assumptions are podium_cuda.attention's; see its docstring.
"""

from __future__ import annotations

from podium_cuda.attention import TritonAttentionBackend


class RocmAttentionBackend(TritonAttentionBackend):
    """TritonAttentionBackend under another name, so reports show which platform's tuning runs."""

    name = "triton-rocm"
    # no fp8_flavour (fp8 KV caches): the fp8 paths have run on NVIDIA only, never on an AMD GPU
