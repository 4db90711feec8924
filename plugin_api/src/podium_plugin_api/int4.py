"""INT4 weight-only layouts in the contract (AWQ and GPTQ, act-order too) and the pure-torch ``int4_linear``.

Both store 4-bit weights eight to an int32, a zero point and a scale per group of ``group_size``
input rows; ``w[k, n] = (q[k, n] - z[g, n]) * s[g, n]`` and the layer computes ``x @ w`` ([K, N])::

    AWQ (AutoAWQ "gemm")  qweight [K, N/8]  nibble i of an int32 holds column 8j + AWQ_ORDER[i]
                          qzeros  [K/G, N/8] packed alike; scales [K/G, N]; g = k // G
    GPTQ (v1)             qweight [K/8, N]  nibble i of row r holds input row 8r + i
                          qzeros  [G', N/8] nibble i holds column 8j + i, stored as z - 1
                          scales  [G', N];  g_idx [K]: the group of each input row (act-order /
                          desc_act permutes it; without it g_idx[k] = k // G)

``int4_linear`` here dequantizes the weight and multiplies in float32 (the definition kernels are
tested against); a platform overrides it with a kernel that reads the packed tensors as they are
(CUDA: a Triton dequant-GEMM).
"""

from __future__ import annotations

import torch

AWQ, GPTQ = "awq", "gptq"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ int32 holds (within 8)
AWQ_SHIFTS = tuple(4 * AWQ_ORDER.index(c) for c in range(8))  # column c's nibble, as a bit shift
_SHIFTS = torch.arange(0, 32, 4)


def unpack_columns(packed: torch.Tensor, awq: bool) -> torch.Tensor:
    """int32 [R, C/8] -> int [R, C]: 8 columns per int32, in AWQ's order or in order."""
    shifts = (torch.tensor(AWQ_SHIFTS) if awq else _SHIFTS).to(packed.device)
    return ((packed[:, :, None] >> shifts) & 15).reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] -> int [R, C]: 8 rows per int32 (GPTQ's qweight)."""
    return ((packed[:, None, :] >> _SHIFTS.to(packed.device)[None, :, None]) & 15).reshape(-1, packed.shape[1])


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               group_size: int, fmt: str) -> torch.Tensor:
    """The float32 weight [K, N] (x @ it is the layer)."""
    if fmt == AWQ:
        q = unpack_columns(qweight, awq=True)  # [K, N]
        zeros = unpack_columns(qzeros, awq=True)  # [K/G, N]
        groups = torch.arange(q.shape[0], device=q.device) // group_size
    elif fmt == GPTQ:
        q = unpack_rows(qweight)  # [K, N]
        zeros = unpack_columns(qzeros, awq=False) + 1
        groups = g_idx.long() if g_idx is not None else torch.arange(q.shape[0], device=q.device) // group_size
    else:
        raise ValueError(f"INT4 format {fmt!r} is not one the contract defines ({AWQ}, {GPTQ})")
    return (q - zeros[groups]).float() * scales.float()[groups]


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, group_size: int, fmt: str,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(...) [K, N] (+ bias) -> [M, N] in x's dtype, computed in float32 (float64 for
    float64 x)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    out = x.to(acc) @ dequantize(qweight, qzeros, scales, g_idx, group_size, fmt).to(acc)
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(x.dtype)


def pack_columns(q: torch.Tensor, awq: bool) -> torch.Tensor:
    """int [R, C] of 0..15 -> int32 [R, C/8]: ``unpack_columns``' inverse."""
    shifts = (torch.tensor(AWQ_SHIFTS) if awq else _SHIFTS).to(q.device)
    packed = (q.reshape(q.shape[0], -1, 8).long() << shifts).sum(-1)  # nibbles do not overlap: sum is or
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize_awq(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """A float weight [N, K] (out, in) rounded to nearest into AWQ's layout, asymmetric per group of
    ``group_size`` inputs: scale (max - min) / 15 (kept to fp16's values, as checkpoints store it), zero
    round(-min / scale); {"qweight", "qzeros", "scales" float32}."""
    w = weight.t().float()  # [K, N]
    k, n = w.shape
    grouped = w.reshape(k // group_size, group_size, n)
    lo, hi = grouped.amin(1), grouped.amax(1)  # [G, N]
    scales = ((hi - lo) / 15).clamp(min=1e-8).half().float()
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(grouped / scales[:, None] + zeros[:, None]).clamp(0, 15).reshape(k, n)
    return {"qweight": pack_columns(q, awq=True), "qzeros": pack_columns(zeros, awq=True), "scales": scales}


def random_packed(fmt: str, in_features: int, out_features: int, group_size: int, act_order: bool = False,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Random packed tensors of ``fmt`` (scales small and positive, weights of order 0.1), for tests of
    kernels against ``int4_linear``: {"qweight", "qzeros", "scales", "g_idx" (GPTQ; a permutation of
    the groups with ``act_order``)}."""
    groups = in_features // group_size

    def bits(*shape: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int64, generator=generator).to(torch.int32)

    scales = (torch.rand(groups, out_features, generator=generator) + 0.5) * 0.02
    if fmt == AWQ:
        return {"qweight": bits(in_features, out_features // 8), "qzeros": bits(groups, out_features // 8),
                "scales": scales}
    g_idx = torch.arange(in_features) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=generator)]
    return {"qweight": bits(in_features // 8, out_features), "qzeros": bits(groups, out_features // 8),
            "scales": scales, "g_idx": g_idx.to(torch.int32)}
