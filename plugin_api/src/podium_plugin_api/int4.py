"""INT4 weight-only layouts in the contract (AWQ and GPTQ, act-order too) and the pure-torch ``int4_linear``.

Both store 4-bit weights eight to an int32, a zero point and a scale per group of ``group_size``
input rows; ``w[k, n] = (q[k, n] - z[g, n]) * s[g, n]`` and the layer computes ``x @ w`` ([K, N])::

    AWQ (AutoAWQ "gemm")  qweight [K, N/8]  nibble i of an int32 holds column 8j + AWQ_ORDER[i]
                          qzeros  [K/G, N/8] packed alike; scales [K/G, N]; g = k // G
    GPTQ (v1)             qweight [K/8, N]  nibble i of row r holds input row 8r + i
                          qzeros  [G', N/8] nibble i holds column 8j + i, stored as z - 1
                          scales  [G', N];  g_idx [K]: the group of each input row (act-order /
                          desc_act permutes it; without it g_idx[k] = k // G)
    AWQ_MMA               AWQ with qweight [N/16, K/64, 32, 4] in the order of ``mma.m16n8k16``'s A
                          fragments (Marlin-style; ``awq_to_mma``): word (t, s, l, u) holds the nibbles of
                          columns 16t + l//4 and 16t + l//4 + 8 at k = 64s + 16(l%4) + 4u + 0..3;
                          nibble i is column + 8 (i % 2) at k offset MMA_K_OF_NIBBLE[i]; qzeros and
                          scales as AWQ's

``int4_linear`` here dequantizes the weight and multiplies in float32 (the definition kernels are
tested against); a platform overrides it with a kernel that reads the packed tensors as they are
(CUDA: a Triton dequant-GEMM).
"""

from __future__ import annotations

import torch

AWQ, GPTQ, AWQ_MMA = "awq", "gptq", "awq_mma"
FORMATS = (AWQ, GPTQ, AWQ_MMA)
MMA_K_OF_NIBBLE = (0, 0, 2, 2, 1, 1, 3, 3)  # AWQ_MMA: the k offset (within a word's 4) nibble i holds
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


def packed_shape(qweight: torch.Tensor, fmt: str) -> tuple[int, int]:
    """(K, N) of the weight ``qweight`` packs in ``fmt``."""
    if fmt == AWQ:
        return qweight.shape[0], qweight.shape[1] * 8
    if fmt == GPTQ:
        return qweight.shape[0] * 8, qweight.shape[1]
    if fmt == AWQ_MMA:
        return qweight.shape[1] * 64, qweight.shape[0] * 16
    raise ValueError(f"INT4 format {fmt!r} is not one the contract defines {FORMATS}")


def _mma_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [N/16, K/64, 8 g, 4 quad, 4 u, 8 nibble] in AWQ_MMA's word order (k = 64s + 16 quad + 4u +
    MMA_K_OF_NIBBLE[i], n = 16t + g + 8 (i % 2)); ``unpack_mma`` undoes it."""
    k, n = q.shape
    q = q.reshape(k // 64, 4, 4, 4, n // 16, 2, 8).permute(4, 0, 6, 1, 2, 3, 5)  # [t, s, g, quad, u, kk, high]
    return q[:, :, :, :, :, list(MMA_K_OF_NIBBLE[::2]), :].reshape(n // 16, k // 64, 8, 4, 4, 8)


def pack_mma(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] of 0..15 -> AWQ_MMA's qweight, int32 [N/16, K/64, 32, 4] (K a multiple of 64, N of 16)."""
    k, n = q.shape
    if k % 64 or n % 16:
        raise ValueError(f"AWQ_MMA packs K a multiple of 64 and N of 16, not [{k}, {n}]")
    words = (_mma_nibbles(q.long()) << _SHIFTS.to(q.device)).sum(-1).reshape(n // 16, k // 64, 32, 4)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def unpack_mma(packed: torch.Tensor) -> torch.Tensor:
    """AWQ_MMA's qweight -> int [K, N] (``pack_mma``'s inverse)."""
    tiles, steps = packed.shape[0], packed.shape[1]
    nibbles = (packed.reshape(tiles, steps, 8, 4, 4)[..., None] >> _SHIFTS.to(packed.device)) & 15
    # [t, s, g, quad, u, nibble (kk order 0, 2, 1, 3; high)]: the k order back (the permutation is its own inverse)
    nibbles = nibbles.reshape(tiles, steps, 8, 4, 4, 4, 2)[:, :, :, :, :, list(MMA_K_OF_NIBBLE[::2]), :]
    return nibbles.permute(1, 3, 4, 5, 0, 6, 2).reshape(steps * 64, tiles * 16)


def awq_to_mma(qweight: torch.Tensor) -> torch.Tensor:
    """An AWQ qweight [K, N/8] in AWQ_MMA's order (its qzeros and scales stay as they are)."""
    return pack_mma(unpack_columns(qweight, awq=True))


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               group_size: int, fmt: str) -> torch.Tensor:
    """The float32 weight [K, N] (x @ it is the layer)."""
    if fmt in (AWQ, AWQ_MMA):
        q = unpack_columns(qweight, awq=True) if fmt == AWQ else unpack_mma(qweight)  # [K, N]
        zeros = unpack_columns(qzeros, awq=True)  # [K/G, N]
        groups = torch.arange(q.shape[0], device=q.device) // group_size
    elif fmt == GPTQ:
        q = unpack_rows(qweight)  # [K, N]
        zeros = unpack_columns(qzeros, awq=False) + 1
        groups = g_idx.long() if g_idx is not None else torch.arange(q.shape[0], device=q.device) // group_size
    else:
        raise ValueError(f"INT4 format {fmt!r} is not one the contract defines {FORMATS}")
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
