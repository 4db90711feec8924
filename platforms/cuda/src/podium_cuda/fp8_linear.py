"""``fp8_linear`` (FP8 W8A8, ``podium_plugin_api.fp8``) on cuBLASLt's scaled matmul, ``torch._scaled_mm``.

Activations are quantized per token by the contract's own function (so the rounding is the
reference's), then one row-wise-scaled e4m3 GEMM: ``scale_a`` the tokens' [M, 1] scales, ``scale_b``
the weight's per-channel (or broadcast per-tensor) [1, N] scales, bf16 out. What it does not take
(block scales, float32/float16 rows, shapes cuBLASLt refuses: K or N not a multiple of 16) goes to
the reference.
"""

from __future__ import annotations

import torch

from podium_plugin_api.fp8 import fp8_linear as reference
from podium_plugin_api.fp8 import quantize_per_token


def _takes(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    n, k = weight.shape
    per_row = weight_scale.numel() == 1 or tuple(weight_scale.shape) == (n, 1)
    return (x.is_cuda and x.dtype == torch.bfloat16 and per_row and n % 16 == 0 and k % 16 == 0
            and weight.is_contiguous())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16, weight e4m3 [N, K], weight_scale [1] or [N, 1] -> [M, N] bf16 (else the reference)."""
    if not _takes(x, weight, weight_scale):
        return reference(x, weight, weight_scale, bias)
    q, s_x = quantize_per_token(x)  # [M, K] e4m3, [M, 1] float32
    n = weight.shape[0]
    s_w = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()  # [1, N]
    out = torch._scaled_mm(q, weight.t(), scale_a=s_x, scale_b=s_w, out_dtype=torch.bfloat16)
    return out if bias is None else out + bias
