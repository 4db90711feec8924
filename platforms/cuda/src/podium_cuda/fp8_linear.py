"""``fp8_linear`` (FP8 W8A8, ``podium_plugin_api.fp8``) on CUDA: cuBLASLt's ``torch._scaled_mm`` or the
Triton GEMM (``fp8_gemm``), chosen per call by ``KernelTuning.fp8_triton_max_rows``.

``_scaled_mm``: activations quantized per token by the contract's own function (a few elementwise
launches), then one row-wise-scaled e4m3 GEMM (``scale_a`` the tokens' [M, 1] scales, ``scale_b`` the
weight's per-channel or broadcast per-tensor [1, N] scales, bf16 rows and out). The Triton GEMM
quantizes inside the kernel (no extra launch: what decides small batches) and takes 128 x 128 block
scales too, which ``_scaled_mm`` is not given here. The rule, measured by benchmarks/quant_gpu.sh
(``quant_gpu_kernels.py`` prints both per 8B shape and row count, and the threshold they imply):

    block scales                                   -> Triton
    rows <= fp8_triton_max_rows                    -> Triton
    otherwise, bf16 rows, N and K multiples of 16  -> _scaled_mm
    anything neither takes (float32/float16 rows for _scaled_mm, K or N not whole tiles)
                                                   -> the other, else the contract's reference
"""

from __future__ import annotations

import torch

from podium_plugin_api.fp8 import fp8_linear as reference
from podium_plugin_api.fp8 import quantize_per_token

from . import fp8_gemm
from .tuning import CUDA_TUNING, KernelTuning


def _scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    n, k = weight.shape
    per_row = weight_scale.numel() == 1 or tuple(weight_scale.shape) == (n, 1)
    return x.is_cuda and x.dtype == torch.bfloat16 and per_row and n % 16 == 0 and k % 16 == 0 and weight.is_contiguous()


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``_scaled_mm`` path (``_scaled_mm_takes`` must hold)."""
    q, s_x = quantize_per_token(x)  # [M, K] e4m3, [M, 1] float32
    n = weight.shape[0]
    s_w = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()  # [1, N]
    out = torch._scaled_mm(q, weight.t(), scale_a=s_x, scale_b=s_w, out_dtype=torch.bfloat16)
    return out if bias is None else out + bias


def choice(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, tuning: KernelTuning) -> str:
    """"triton", "scaled_mm" or "reference" for this call (module docstring)."""
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
    if path == "triton":
        return fp8_gemm.fp8_gemm(x, weight, weight_scale, bias, fp8_dot=not fp8_gemm.interpreting())
    if path == "scaled_mm":
        return scaled_mm_linear(x, weight, weight_scale, bias)
    return reference(x, weight, weight_scale, bias)
