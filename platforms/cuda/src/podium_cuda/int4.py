"""``int4_linear`` (AWQ / GPTQ weight-only INT4, ``podium_plugin_api.int4``) as Triton dequant-GEMMs.

The kernels read the packed tensors as they are (no copy: the weight memory stays the packed size)
and dequantize a [BLOCK_K, BLOCK_N] tile in registers, ``(q - z) * s`` in float32: an int32 of qweight
gives 8 columns (AWQ, in AWQ's nibble order), 8 input rows (GPTQ), or 4 input rows of 2 columns
(AWQ_MMA, the layout the platform converts AWQ weights to for awq_mma_gemv.py: the tile's columns come
out in the words' order, (tile, g, g + 8), and the scales, zeros, bias and output follow that order),
expanded with shifts; zeros and scales come once per tile where the tile lies in one group (no
act-order, BLOCK_K dividing the group), else per input row through ``g_idx`` (act-order / desc_act).

- up to ``KernelTuning.int4_gemv_max_rows`` rows (batch-1 decode): int4_gemv.py's split-K GEMV, which
  also takes the RMSNorm / SiLU-and-mul before the layer into its prologue (``prologue_linear``);
- up to ``KernelTuning.int4_mma_max_rows`` AWQ_MMA rows: awq_mma_gemv.py (through int4_gemv.py);
- one row where those do not take it (act-order GPTQ): the GEMV here, ``tl.sum`` of x times the tile;
  K is split over ``split_k`` programs per column block so that a small projection still fills the
  GPU, their float32 partial sums added by one torch ``sum`` (a fixed order: the result is
  deterministic);
- more rows (and AWQ_MMA rows the MMA GEMV does not take): a tiled GEMM, the tile rounded to the
  activations' dtype (bf16/fp16: tensor cores; float32: exact products) into float32 sums; K split
  the same way for one row tile of up to 16 rows whose column tiles alone make too few programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from podium_plugin_api.int4 import AWQ, AWQ_MMA, GPTQ
from podium_plugin_api.int4 import int4_linear as reference

from . import int4_gemv
from .fp8_gemm import interpreting
from .prologue import ADD_RMSNORM, RMSNORM, SILU
from .tuning import CUDA_TUNING, KernelTuning

GEMV_BLOCK_N, GEMV_BLOCK_K = 64, 128
GEMM_BLOCK_N, GEMM_BLOCK_K = 128, 64
TARGET_PROGRAMS = 264  # about two programs per SM of an H100/H200 (132 SMs)


@triton.jit
def _awq_shift(c):
    """The bit shift of column c (0..7) in an AWQ int32: AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)."""
    return 4 * ((c % 2) * 4 + c // 2)


@triton.jit
def _columns(packed, BLOCK_N: tl.constexpr, AWQ_ORDER: tl.constexpr):
    """int32 [R, BLOCK_N / 8] -> int32 [R, BLOCK_N]: 8 columns per int32 (AWQ's order or in order)."""
    c = tl.arange(0, 8)
    shift = _awq_shift(c) if AWQ_ORDER else 4 * c
    nibbles = (packed[:, :, None] >> shift[None, None, :]) & 15
    return tl.reshape(nibbles, (packed.shape[0], BLOCK_N))


@triton.jit
def mma_columns(n0, BLOCK_N: tl.constexpr):
    """AWQ_MMA: the column of each position of a tile from n0 (``_mma_tile``'s order). A word-grid column c
    holds the columns of lane group c % 8 of 16-column tile c // 8, and the same 8 on (its high nibbles):
    position p is grid column p // 2, high where p is odd."""
    p = tl.arange(0, BLOCK_N)
    return n0 + 16 * (p // 16) + 8 * (p % 2) + (p // 2) % 8


@triton.jit
def _mma_tile(qw_ptr, k0, n0, K, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """AWQ_MMA's q [BLOCK_K, BLOCK_N] at rows k0.. (a multiple of 64), columns n0.. (of 16) in ``mma_columns``'
    B-operand order: word (tile t, super-step s, lane 4 g + quad, u) is at ((t K/64 + s) 32 + 4 g + quad) 4 + u
    and holds rows 64 s + 16 quad + 4 u + 0..3 of columns 16 t + g, 16 t + g + 8, so a [BLOCK_K / 4, BLOCK_N / 2]
    grid of words (row 4 quad + u of each super-step, column 8 t + g) unpacks to [BLOCK_K / 4, 4, BLOCK_N / 2, 2]."""
    r = tl.arange(0, BLOCK_K // 4)
    c = tl.arange(0, BLOCK_N // 2)
    step = k0 // 64 + r // 16
    tile = n0 // 16 + c // 8
    offs = (tile[None, :].to(tl.int64) * (K // 64) + step[:, None]) * 128 + 16 * (c % 8)[None, :] + (r % 16)[:, None]
    words = tl.load(qw_ptr + offs)
    kk = tl.arange(0, 4)[:, None]
    high = tl.arange(0, 2)[None, :]
    # nibble i holds k offset MMA_K_OF_NIBBLE[i] = (0, 0, 2, 2, 1, 1, 3, 3)[i] and column 8 (i % 2) on:
    # k offset kk is nibble 4 (kk % 2) + 2 (kk // 2) + high
    shift = 4 * (4 * (kk % 2) + 2 * (kk // 2) + high)  # [4, 2]
    q = (words[:, None, :, None] >> shift[None, :, None, :]) & 15
    return tl.reshape(q, (BLOCK_K, BLOCK_N))


@triton.jit
def _weight_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, n0, N, K, group_size,
                 IS_AWQ: tl.constexpr, ONE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 MMA: tl.constexpr = False):
    """The dequantized weight w[k0 : k0 + BLOCK_K, n0 : n0 + BLOCK_N], float32 (K and N whole tiles; MMA:
    AWQ_MMA's, columns in ``mma_columns``' B-operand order, IS_AWQ and ONE_GROUP with it)."""
    k = k0 + tl.arange(0, BLOCK_K)
    n = n0 + tl.arange(0, BLOCK_N)
    words = n0 // 8 + tl.arange(0, BLOCK_N // 8)  # the int32 columns of qweight (AWQ) and qzeros
    if MMA:
        q = _mma_tile(qw_ptr, k0, n0, K, BLOCK_K, BLOCK_N)
        cols = mma_columns(n0, BLOCK_N)
        g = k0 // group_size
        z = (tl.load(qz_ptr + g * (N // 8) + cols // 8)[None, :] >> _awq_shift(cols % 8)[None, :]) & 15
        return (q - z).to(tl.float32) * tl.load(s_ptr + g * N + cols)[None, :].to(tl.float32)
    if IS_AWQ:
        q = _columns(tl.load(qw_ptr + k[:, None].to(tl.int64) * (N // 8) + words[None, :]), BLOCK_N, True)
    else:  # GPTQ: int32 row r holds input rows 8r .. 8r + 7
        rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(qw_ptr + rows[:, None].to(tl.int64) * N + n[None, :])  # [BK / 8, BN]
        q = tl.reshape((packed[:, None, :] >> (4 * tl.arange(0, 8))[None, :, None]) & 15, (BLOCK_K, BLOCK_N))
    if ONE_GROUP:  # the tile's rows share one group: its zeros and scales are one row
        g = k0 // group_size
        z = _columns(tl.load(qz_ptr + g * (N // 8) + words)[None, :], BLOCK_N, IS_AWQ)  # [1, BN]
        s = tl.load(s_ptr + g * N + n)[None, :]
    else:
        g = tl.load(g_ptr + k) if not IS_AWQ else k // group_size  # [BK]
        z = _columns(tl.load(qz_ptr + g[:, None].to(tl.int64) * (N // 8) + words[None, :]), BLOCK_N, IS_AWQ)
        s = tl.load(s_ptr + g[:, None].to(tl.int64) * N + n[None, :])
    if not IS_AWQ:
        z = z + 1  # GPTQ stores z - 1
    return (q - z).to(tl.float32) * s.to(tl.float32)


@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, partial_ptr, N, K, group_size, k_per_split,
                      IS_AWQ: tl.constexpr, ONE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """partial[split, n] = sum over this split's K of x[k] w[k, n] (one x row)."""
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(split * k_per_split, tl.minimum(K, (split + 1) * k_per_split), BLOCK_K):
        x = tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
        w = _weight_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, n0, N, K, group_size, IS_AWQ, ONE_GROUP, BLOCK_K, BLOCK_N)
        acc += tl.sum(x[:, None] * w, axis=0)
    tl.store(partial_ptr + split.to(tl.int64) * N + n0 + tl.arange(0, BLOCK_N), acc)


@triton.jit
def _int4_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, b_ptr, out_ptr, M, N, K, x_stride, out_stride, group_size,
                      k_per_split, IS_AWQ: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      FP32: tl.constexpr, MMA: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [M, N] = x @ w (+ bias); SPLIT: program (.., .., s) adds rows k_per_split s.. of K into float32
    partial sums out[s] ([splits, M, N], no bias). MMA: AWQ_MMA's weight (its columns in ``mma_columns``'
    order)."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = mma_columns(pid_n * BLOCK_N, BLOCK_N) if MMA else pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * k_per_split, tl.minimum(K, (split + 1) * k_per_split), BLOCK_K):
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * x_stride + k0 + tl.arange(0, BLOCK_K)[None, :],
                    mask=m_ok[:, None], other=0.0)
        w = _weight_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, pid_n * BLOCK_N, N, K, group_size, IS_AWQ, ONE_GROUP,
                         BLOCK_K, BLOCK_N, MMA)
        if FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if SPLIT:
        out_ptr += split.to(tl.int64) * M * N
    elif HAS_BIAS:
        acc += tl.load(b_ptr + n).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None])


def _takes(x: torch.Tensor, n: int, k: int, fmt: str, block_k: int, block_n: int) -> bool:
    return (x.device.type != "cpu" or interpreting()) and fmt in (AWQ, GPTQ, AWQ_MMA) and k % block_k == 0 \
        and n % block_n == 0 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def split_k(n: int, k: int, block_n: int = GEMV_BLOCK_N, block_k: int = GEMV_BLOCK_K) -> int:
    """How many programs share a column block's K: enough to reach TARGET_PROGRAMS."""
    wanted = triton.cdiv(TARGET_PROGRAMS, n // block_n)
    return max(1, min(wanted, k // block_k))


def _gemm_blocks(n: int, fmt: str) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_N) of the GEMM: AWQ_MMA's tiles are whole super-steps (64 rows) and 16-column tiles,
    its N any multiple of 16."""
    if fmt != AWQ_MMA:
        return GEMM_BLOCK_K, GEMM_BLOCK_N
    return 64, next(b for b in (GEMM_BLOCK_N, 64, 32, 16) if n % b == 0)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, group_size: int, fmt: str,
                bias: torch.Tensor | None = None, tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """x [M, K] @ the packed weight [K, N] (+ bias) -> [M, N] in x's dtype (module docstring); shapes the
    kernels do not tile (K or N not whole tiles) go to the contract's reference."""
    rows, k = x.shape
    n = scales.shape[1]
    if _gemv_takes(x, n, k, g_idx, group_size, fmt, tuning):
        return int4_gemv.int4_gemv(x, qweight, qzeros, scales, group_size, fmt, bias, tuning=tuning)[0]
    gemv = rows == 1 and fmt != AWQ_MMA
    block_k, block_n = (GEMV_BLOCK_K, GEMV_BLOCK_N) if gemv else _gemm_blocks(n, fmt)
    if not _takes(x, n, k, fmt, block_k, block_n):
        return reference(x, qweight, qzeros, scales, g_idx, group_size, fmt, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    is_awq = fmt != GPTQ
    one_group = group_size % block_k == 0 and (is_awq or g_idx is None or _in_order(g_idx, group_size))
    g_ptr = g_idx if g_idx is not None else scales  # unread where one_group
    if gemv:
        splits = split_k(n, k)
        per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
        partial = torch.empty((triton.cdiv(k, per_split), n), dtype=torch.float32, device=x.device)
        _int4_gemv_kernel[(n // block_n, partial.shape[0])](
            x, qweight, qzeros, scales, g_ptr, partial, n, k, group_size, per_split, IS_AWQ=is_awq,
            ONE_GROUP=one_group, BLOCK_K=block_k, BLOCK_N=block_n)
        out = partial.sum(0, keepdim=True)
        return (out if bias is None else out + bias.float()).to(x.dtype)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    row_tiles = triton.cdiv(rows, block_m)
    # K split only for one row tile of up to 16 rows (a few rows past the GEMVs'); larger tiles keep the
    # whole K, as before the split existed
    few = block_m == 16 and n // block_n < TARGET_PROGRAMS // 4
    splits = split_k(n, k, block_n, block_k) if few else 1
    per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, per_split)
    out = torch.empty((splits, rows, n) if splits > 1 else (rows, n), dtype=torch.float32 if splits > 1 else x.dtype,
                      device=x.device)
    _int4_gemm_kernel[(row_tiles, n // block_n, splits)](
        x, qweight, qzeros, scales, g_ptr, bias if bias is not None else out, out, rows, n, k, x.stride(0),
        out.stride(-2), group_size, per_split, IS_AWQ=is_awq, ONE_GROUP=one_group, HAS_BIAS=bias is not None,
        FP32=x.dtype == torch.float32, MMA=fmt == AWQ_MMA,
        SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4, num_stages=3)
    if splits == 1:
        return out
    out = out.sum(0)  # the partial sums in a fixed order: deterministic
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _gemv_takes(x: torch.Tensor, n: int, k: int, g_idx: torch.Tensor | None, group_size: int, fmt: str,
                tuning: KernelTuning) -> bool:
    in_order = fmt != GPTQ or g_idx is None or _in_order(g_idx, group_size)
    return int4_gemv.takes(x, n, k, group_size, fmt, in_order, tuning.int4_gemv_max_rows, tuning.int4_mma_max_rows)


def prologue_linear(x: torch.Tensor, prologue: int, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
                    eps: float, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, group_size: int, fmt: str, bias: torch.Tensor | None,
                    tuning: KernelTuning) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(int4_linear(prologue(x)), x + residual for ADD_RMSNORM else None) through the GEMV, or None where it
    does not take the call (the caller then runs the separate elementwise kernel and the layer)."""
    n = scales.shape[1]
    k = scales.shape[0] * group_size if fmt != GPTQ or g_idx is None else g_idx.shape[0]
    if x.dim() != 2 or x.shape[1] != (2 * k if prologue == SILU else k) or x.stride(-1) != 1:
        return None
    if prologue == ADD_RMSNORM and (residual is None or residual.shape != x.shape or residual.dtype != x.dtype):
        return None
    if prologue in (RMSNORM, ADD_RMSNORM) and (norm_weight is None or norm_weight.shape != (k,)
                                              or norm_weight.dtype != x.dtype):
        return None
    if not _gemv_takes(x[:, :k], n, k, g_idx, group_size, fmt, tuning):
        return None
    return int4_gemv.int4_gemv(x, qweight, qzeros, scales, group_size, fmt, bias, prologue, residual, norm_weight,
                               eps, tuning)


def _in_order(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether a GPTQ g_idx is the plain k // group_size (no act-order): once per weight, cached on it."""
    cached = getattr(g_idx, "_podium_in_order", None)
    if cached is None:
        expected = torch.arange(g_idx.shape[0], device=g_idx.device) // group_size
        cached = bool(torch.equal(g_idx.long(), expected))
        g_idx._podium_in_order = cached
    return cached


INT4_OPS = {"int4_linear": int4_linear}
