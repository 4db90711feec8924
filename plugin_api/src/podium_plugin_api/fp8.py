"""FP8 W8A8 in the contract: the weight-scale granularities and the pure-torch ``fp8_linear`` op.

A weight is float8_e4m3fn [N, K] with a float32 scale per tensor ([1]), per output channel
([N, 1]) or per 128 x 128 block ([ceil(N/128), ceil(K/128)]). Activations are quantized per token
at run time: ``s_x[t] = max|x[t]| / 448``, ``x_q = e4m3(x / s_x)``; the product of the quantized
operands is summed in float32 and scaled back by ``s_x[t] * s_w``. A platform overrides the op
with its kernel (CUDA: ``torch._scaled_mm``) and is tested against this reference.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128


def expand_scale(scale: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """Any of the three scale shapes -> float32 [rows, columns] (one scale per weight)."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, columns)
    if scale.shape == (rows, 1):
        return scale.expand(rows, columns)
    return scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :columns]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (fp8 [T, K], float32 scales [T, 1]) with x ~ q * s; an all-zero row gets scale 1."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    # divided by a tensor: CUDA divides by a Python number as a product with its float32 reciprocal,
    # which is not amax / 448 in the last bit; this way every device (and kernel) gets the same scale
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (quantized per token here), weight fp8 [N, K], weight_scale (tensor/channel/block) -> [T, N]
    in x's dtype: the W8A8 product in float32."""
    q, s_x = quantize_per_token(x)
    w = weight.float() * expand_scale(weight_scale.float(), *weight.shape)
    out = (q.float() @ w.t()) * s_x
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
