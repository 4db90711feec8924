"""``gguf_linear`` and ``gguf_embedding`` on GGUF blocks kept quantized: native/gguf_linear.c.

One C entry per (block type, row dtype), with the plain native linear's signature, so a decode step
of them is captured and replayed as a CPU graph like the float linears. Rows of another dtype,
odd strides or a type without an entry go to the contract's reference (dequantize, then F.linear).
"""

from __future__ import annotations

import torch

from podium_plugin_api.gguf_blocks import BLOCKS
from podium_plugin_api.gguf_blocks import gguf_embedding as reference_embedding
from podium_plugin_api.gguf_blocks import gguf_linear as reference_linear

from .native_kernels import NativeKernels

AMX_MIN_ROWS = 8  # gguf_linear.c's: the fewest rows a call takes to the 512-bit batch path


def allow_amx(kernels: NativeKernels | None, allowed: bool) -> None:
    """The platform's ``amx`` option applied to the GGUF batches: AMX-INT8 tiles where this process can
    use AMX (``amx_linear`` is filled only then) and the option allows; else the VNNI / AVX2 paths. The
    switch is process-wide (gguf_linear.c's ``amx_on``): the platform sets it when it hands out its ops,
    so the engine started last in a process decides."""
    if kernels is not None and kernels.gguf_amx is not None:
        kernels.gguf_amx(1 if allowed and kernels.amx_linear else 0)


def batch_path(kernels: NativeKernels | None, why_not: str = "") -> str:
    """Which kernel the kept GGUF linears' batches run now, and from how many rows (the switches'
    state: gguf_linear.c's podium_gguf_amx and podium_gguf_vnni512, asked without changing them)."""
    if kernels is None or kernels.gguf_amx is None or kernels.gguf_vnni512 is None:
        return f"the contract's reference (dequantize, then F.linear): no native kernels ({why_not or 'not built'})"
    rows = "the AVX2 / VNNI-256 rows (gguf_linear.c)"
    if kernels.gguf_amx(-1):
        return f"AMX-INT8 tiles (gguf_amx.h) from {AMX_MIN_ROWS} rows, fewer on {rows}"
    if kernels.gguf_vnni512(-1):
        return f"AVX-512 VNNI in the AMX tiles' layout (gguf_amx.h) from {AMX_MIN_ROWS} rows, fewer on {rows}"
    return f"{rows} for every batch"


def gguf_linear(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor, ggml_type: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] . dequantize(weight [N, row_bytes])^T (+ bias) -> [M, N] in x's dtype."""
    entry = kernels.gguf_linear.get(ggml_type, {}).get(x.dtype)
    if entry is None or x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous() or x.device.type != "cpu":
        return reference_linear(x, weight, ggml_type, bias)
    rows, columns = x.shape
    out = torch.empty((rows, weight.shape[0]), dtype=x.dtype)  # [M, N]
    bias_f32 = None if bias is None else bias.float()
    rc = entry(x.data_ptr(), x.stride(0), rows, weight.data_ptr(), weight.shape[0], columns,
               None if bias_f32 is None else bias_f32.data_ptr(), out.data_ptr(), out.stride(0),
               torch.get_num_threads())
    if rc != 0:
        raise MemoryError("the GGUF linear kernel could not allocate its scratch rows")
    return out


def gguf_embedding(kernels: NativeKernels, ids: torch.Tensor, weight: torch.Tensor, ggml_type: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """ids int64 [T] -> rows of ``weight`` dequantized, [T, columns] in ``dtype``."""
    entry = kernels.gguf_embed.get(ggml_type, {}).get(dtype)
    if entry is None or ids.dim() != 1 or ids.dtype != torch.int64 or not ids.is_contiguous() \
            or not weight.is_contiguous():
        return reference_embedding(ids, weight, ggml_type, dtype)
    weights, nbytes = BLOCKS[ggml_type]
    dim = weight.shape[1] // nbytes * weights
    out = torch.empty((ids.shape[0], dim), dtype=dtype)
    if entry(weight.data_ptr(), weight.shape[0], dim, ids.data_ptr(), ids.shape[0], out.data_ptr(),
             torch.get_num_threads()) != 0:
        low, high = torch.aminmax(ids)
        raise IndexError(f"token ids must be in [0, {weight.shape[0]}), got [{int(low)}, {int(high)}]")
    return out
