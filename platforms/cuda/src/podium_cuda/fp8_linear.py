"""``fp8_linear`` (FP8 W8A8, ``podium_plugin_api.fp8``) on CUDA, and the FP8 layer behind an RMSNorm or
SiLU-and-mul (``prologue_linear``, for the fused ops): per call, the first that takes it of

    the FP8 GEMV      rows <= fp8_gemv_max_rows, per-tensor / per-channel scales (fp8_gemv.py: the
                      prologue and the rows' quantization inside; one launch)
    the Triton GEMM   block scales, or rows <= fp8_triton_max_rows (fp8_gemm.py; no prologue)
    _scaled_mm        bf16 rows, N and K multiples of 16: the rows quantized by one Triton launch
                      with the prologue inside (fp8_quant.py; ``fp8_fused_quant``, else the contract's
                      torch function after the separate norm / SiLU), then cuBLASLt's row-wise
                      scaled e4m3 GEMM (``scale_a`` the rows' [M, 1] scales, ``scale_b`` the weight's
                      per-channel or broadcast per-tensor [1, N] scales, bf16 out)
    the reference     anything else (float32 / float16 rows for _scaled_mm, odd shapes)

The row thresholds are ``KernelTuning`` fields; benchmarks/quant_gpu.sh times every path per 8B
shape and row count and prints the values the timings imply.
"""

from __future__ import annotations

import torch

from podium_plugin_api.fp8 import fp8_linear as reference
from podium_plugin_api.fp8 import quantize_per_token

from . import fp8_gemm, fp8_gemv, fp8_quant
from .prologue import ADD_RMSNORM, RMSNORM, SILU
from .tuning import CUDA_TUNING, KernelTuning


def _scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    n, k = weight.shape
    per_row = weight_scale.numel() == 1 or tuple(weight_scale.shape) == (n, 1)
    return x.is_cuda and x.dtype == torch.bfloat16 and per_row and n % 16 == 0 and k % 16 == 0 and weight.is_contiguous()


def scaled_mm(q: torch.Tensor, s_x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """q e4m3 [M, K] with its rows' scales [M, 1] times the e4m3 weight [N, K] -> bf16 [M, N].
    ``fast_accum``: the tensor cores' own fp8 accumulation, never promoted to float32 (tuning.py)."""
    n = weight.shape[0]
    s_w = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()  # [1, N]
    out = torch._scaled_mm(q, weight.t(), scale_a=s_x, scale_b=s_w, out_dtype=torch.bfloat16,
                           use_fast_accum=fast_accum)
    return out if bias is None else out + bias


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, fused_quant: bool = True,
                     fast_accum: bool = False) -> torch.Tensor:
    """The ``_scaled_mm`` path (``_scaled_mm_takes`` must hold): the rows quantized in one Triton launch,
    or by the contract's torch function (``fused_quant`` False)."""
    q, s_x = fp8_quant.quantize_per_token(x) if fused_quant else quantize_per_token(x)  # [M, K] e4m3, [M, 1]
    return scaled_mm(q, s_x, weight, weight_scale, bias, fast_accum)


def choice(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, tuning: KernelTuning) -> str:
    """"gemv", "triton", "scaled_mm" or "reference" for this call (module docstring)."""
    if fp8_gemv.takes(x, weight, weight_scale, tuning.fp8_gemv_max_rows):
        return "gemv"
    triton_ok = (x.is_cuda or fp8_gemm.interpreting()) and fp8_gemm.takes(x, weight)
    scaled_ok = _scaled_mm_takes(x, weight, weight_scale)
    blocks = weight_scale.numel() != 1 and tuple(weight_scale.shape) != (weight.shape[0], 1)
    if triton_ok and (blocks or x.shape[0] <= tuning.fp8_triton_max_rows or not scaled_ok):
        return "triton"
    return "scaled_mm" if scaled_ok else "reference"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """x [M, K], weight e4m3 [N, K], weight_scale [1], [N, 1] or [N/128, K/128] -> [M, N] in x's dtype."""
    path = choice(x, weight, weight_scale, tuning)
    if path == "gemv":
        return fp8_gemv.fp8_gemv(x, weight, weight_scale, bias, tuning=tuning)[0]
    if path == "triton":
        return fp8_gemm.fp8_gemm(x, weight, weight_scale, bias, fp8_dot=not fp8_gemm.interpreting())
    if path == "scaled_mm":
        return scaled_mm_linear(x, weight, weight_scale, bias, tuning.fp8_fused_quant, tuning.fp8_fast_accum)
    return reference(x, weight, weight_scale, bias)


def prologue_linear(x: torch.Tensor, prologue: int, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
                    eps: float, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                    tuning: KernelTuning) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(fp8_linear(prologue(x)), x + residual for ADD_RMSNORM else None) in the launches this module's
    rule picks (the GEMV, or the fused quantization and _scaled_mm); None where neither takes the call
    (the caller then runs the separate elementwise kernel and the layer). x [M, K] (SILU: [M, 2K])."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != (2 * k if prologue == SILU else k) or x.stride(-1) != 1:
        return None
    if prologue == ADD_RMSNORM and (residual is None or residual.shape != x.shape or residual.dtype != x.dtype):
        return None
    if prologue in (RMSNORM, ADD_RMSNORM) and (norm_weight is None or norm_weight.shape != (k,)
                                              or norm_weight.dtype != x.dtype):
        return None
    if fp8_gemv.takes(x, weight, weight_scale, tuning.fp8_gemv_max_rows):
        return fp8_gemv.fp8_gemv(x, weight, weight_scale, bias, prologue, residual, norm_weight, eps, tuning)
    if not tuning.fp8_fused_quant or x.shape[0] <= tuning.fp8_triton_max_rows or \
            not _scaled_mm_takes(x[:, :k], weight, weight_scale):
        return None
    q, s_x, summed = fp8_quant.quantize(x, prologue, residual, norm_weight, eps)
    return scaled_mm(q, s_x, weight, weight_scale, bias, tuning.fp8_fast_accum), summed

