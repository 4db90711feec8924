"""INT4 weight-only (AWQ / GPTQ, ``podium_plugin_api.int4``) at a few rows: a split-K GEMV over the packed
weight as stored, with the norm or SiLU-and-mul before it (prologue.py) inside the kernel.

A program owns BLOCK_N output columns and one of ``splits`` slices of K, and walks its slice in
[BLOCK_K, BLOCK_N] tiles, BLOCK_K dividing the group (one zero and scale per column a tile):

    AWQ   qweight [K, N/8]: a tile is BLOCK_K rows of BLOCK_N / 8 int32 (BLOCK_N / 2 contiguous bytes a
          row); nibble i of word j holds column 8j + AWQ_ORDER[i]. The tile stays [BLOCK_K, BLOCK_N/8, 8]
          in that order (the zeros pack the same way, so nibble i of a zero word matches nibble i of a
          weight word), and scales, bias and outputs are read / written at the permuted columns:
          nothing is reordered in registers.
    GPTQ  qweight [K/8, N]: BLOCK_K / 8 rows of BLOCK_N int32, nibble i of a word is input row 8r + i;
          the tile is [BLOCK_K/8, 8, BLOCK_N] against x as [BLOCK_K/8, 8]. Zeros stored as z - 1.

A nibble becomes a float without a conversion instruction: ``q | 0x4B000000`` is the float 2^23 + q,
and the zero's nibble the same way, so ``(2^23 + q) - (2^23 + z)`` is q - z exactly in one
subtraction. The tile's rows times x are summed, then scaled by the group's scale once per column.
The split's sums go to a float32 scratch; the last program of a column block to finish (an atomic
count per block) adds the ``splits`` partial sums in split order (deterministic), adds the bias and
writes the row, then resets the count for the next launch: one launch, no memset, no second
kernel. Rows (at most ``MAX_ROWS``) are taken one after another against the tile in registers, so
the weight is read and unpacked once whatever their number.

Act-order GPTQ (a permuted ``g_idx``) is not taken here (the scale changes row by row): int4.py's
kernels compute it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from podium_plugin_api.int4 import AWQ, AWQ_MMA, GPTQ, packed_shape

from . import awq_gemv, awq_mma_gemv
from .fp8_gemm import interpreting
from .gemv import _multiprocessors
from .pdl import dependent_launch, gdc_launch_dependents, gdc_wait, launch_options
from .prologue import ADD_RMSNORM, PLAIN, RMSNORM, SILU, input_chunk, pick, rows_rstd
from .split_k import counters, last_split, reset
from .tuning import CUDA_TUNING, KernelTuning, next_power_of_2

MAX_ROWS = 16
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAGIC = 0x4B000000  # the float 2^23: OR-ing a nibble into its mantissa gives 2^23 + nibble


@triton.jit
def _nibble_floats(words, shifts):
    """2^23 + ((words >> shifts) & 15) as float32 (broadcast shapes)."""
    return (((words >> shifts) & 15) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _tile(qw_ptr, qz_ptr, k0, n0, N, group_size, N_OK, IS_AWQ: tl.constexpr, BLOCK_K: tl.constexpr,
          BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """(q - z) of the tile at rows k0.., columns n0.., float32: AWQ [BLOCK_K, BLOCK_N/8, 8],
    GPTQ [BLOCK_K/8, 8, BLOCK_N]. N_OK: the tile's valid words (AWQ, [BLOCK_N/8]) or columns (GPTQ,
    [BLOCK_N]); unread where EVEN_N."""
    nib = tl.arange(0, 8)
    g = k0 // group_size
    if IS_AWQ:
        words = n0 // 8 + tl.arange(0, BLOCK_N // 8)
        k = k0 + tl.arange(0, BLOCK_K)
        ptrs = qw_ptr + k[:, None].to(tl.int64) * (N // 8) + words[None, :]
        zptrs = qz_ptr + g * (N // 8) + words
        if EVEN_N:
            packed = tl.load(ptrs)
            zpacked = tl.load(zptrs)
        else:
            packed = tl.load(ptrs, mask=N_OK[None, :], other=0)
            zpacked = tl.load(zptrs, mask=N_OK, other=0)
        # nibble i of every word, in storage order: position i of the last axis is column 8j + AWQ_ORDER[i]
        q = _nibble_floats(packed[:, :, None], (4 * nib)[None, None, :])
        z = _nibble_floats(zpacked[None, :, None], (4 * nib)[None, None, :])
        tile = q - z
    else:
        n = n0 + tl.arange(0, BLOCK_N)
        r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        ptrs = qw_ptr + r[:, None].to(tl.int64) * N + n[None, :]
        zptrs = qz_ptr + g * (N // 8) + n // 8
        if EVEN_N:
            packed = tl.load(ptrs)
            zpacked = tl.load(zptrs)
        else:
            packed = tl.load(ptrs, mask=N_OK[None, :], other=0)
            zpacked = tl.load(zptrs, mask=N_OK, other=0)
        q = _nibble_floats(packed[:, None, :], 4 * nib[None, :, None])
        z = _nibble_floats(zpacked[None, None, :], (4 * (n % 8))[None, None, :]) + 1.0  # GPTQ stores z - 1
        tile = q - z
    return tile


@triton.jit
def _columns(n0, IS_AWQ: tl.constexpr, BLOCK_N: tl.constexpr):
    """The output column of each accumulator position: AWQ [1, BLOCK_N/8, 8], GPTQ [1, BLOCK_N]."""
    if IS_AWQ:
        words = n0 // 8 + tl.arange(0, BLOCK_N // 8)
        nib = tl.arange(0, 8)
        order = (nib % 4) * 2 + nib // 4  # AWQ_ORDER[i]: the column nibble i holds
        cols = (8 * words[:, None] + order[None, :])[None, :, :]
    else:
        cols = (n0 + tl.arange(0, BLOCK_N))[None, :]
    return cols


@triton.jit
def int4_gemv_kernel(
    out_ptr, partial_ptr, count_ptr, sum_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, x_ptr, r_ptr, g_ptr,
    M, N, K, group_size, k_per_split, splits, stride_x, stride_r, stride_o, eps,
    IS_AWQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """out [M, N] = prologue(x) @ W (+ bias). Grid (cdiv(N, BLOCK_N), splits)."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BLOCK_N
    cols = _columns(n0, IS_AWQ, BLOCK_N)  # [1, ...]
    n_ok = cols < N
    if IS_AWQ:
        words_ok = n0 // 8 + tl.arange(0, BLOCK_N // 8) < N // 8
        rows = tl.arange(0, BLOCK_M)[:, None, None]
    else:
        words_ok = n0 + tl.arange(0, BLOCK_N) < N
        rows = tl.arange(0, BLOCK_M)[:, None]
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w = _tile(qw_ptr, qz_ptr, k_start, n0, N, group_size, words_ok, IS_AWQ, BLOCK_K, BLOCK_N, EVEN_N)
    if PDL:  # the first tile is in flight; everything below reads what earlier kernels write
        gdc_launch_dependents()
        gdc_wait()
    m2 = tl.arange(0, BLOCK_M)[:, None]
    row_ok = m2 < M
    rstd = rows_rstd(x_ptr + m2.to(tl.int64) * stride_x, r_ptr + m2.to(tl.int64) * stride_r,
                     sum_ptr + m2.to(tl.int64) * K, row_ok, K, eps, pid_n + split, PROLOGUE, NORM_BLOCK)
    acc = tl.zeros(rows.shape, dtype=tl.float32) + tl.zeros(cols.shape, dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if k0 > k_start:
            w = _tile(qw_ptr, qz_ptr, k0, n0, N, group_size, words_ok, IS_AWQ, BLOCK_K, BLOCK_N, EVEN_N)
        s = tl.load(s_ptr + (k0 // group_size) * N + cols, mask=n_ok, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            if IS_AWQ:
                kk = k0 + tl.arange(0, BLOCK_K)
            else:
                kk = k0 + 8 * tl.arange(0, BLOCK_K // 8)[:, None] + tl.arange(0, 8)[None, :]
            ok = tl.zeros_like(kk) + m < M
            x = input_chunk(x_ptr + m * stride_x, r_ptr + m * stride_r, g_ptr, pick(rstd, m2, m), kk, ok, K,
                            PROLOGUE)
            if IS_AWQ:
                part = tl.sum(x[:, None, None] * w, 0)[None, :, :] * s
            else:
                part = tl.sum(tl.sum(x[:, :, None] * w, 0), 0)[None, :] * s
            if BLOCK_M == 1:
                acc += part
            else:
                acc = tl.where(rows == m, acc + part, acc)
    out_ok = (rows < M) & n_ok
    if splits == 1:
        _finish(out_ptr, b_ptr, acc, rows, cols, out_ok, stride_o, HAS_BIAS)
    else:
        tl.store(partial_ptr + (split * M + rows).to(tl.int64) * N + cols, acc, mask=out_ok)
        if last_split(count_ptr, pid_n, splits):
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for other in range(0, splits):
                total += tl.load(partial_ptr + (other * M + rows).to(tl.int64) * N + cols, mask=out_ok, other=0.0,
                                 cache_modifier=".cg")
            _finish(out_ptr, b_ptr, total, rows, cols, out_ok, stride_o, HAS_BIAS)
            reset(count_ptr, pid_n, splits)


@triton.jit
def _finish(out_ptr, b_ptr, acc, rows, cols, ok, stride_o, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def takes(x: torch.Tensor, n: int, k: int, group_size: int, fmt: str, in_order: bool, max_rows: int,
          mma_rows: int = awq_mma_gemv.MAX_ROWS) -> bool:
    """Whether a call goes here: 1..min(max_rows, MAX_ROWS) rows on the device (or the interpreter), AWQ or
    GPTQ without act-order (``in_order``), groups a whole number of 32-row tiles; AWQ_MMA where
    awq_mma_gemv.py takes it (up to ``mma_rows`` rows)."""
    if fmt == AWQ_MMA:
        return awq_mma_gemv.takes(x, n, k, group_size, mma_rows)
    return (x.dim() == 2 and 1 <= x.shape[0] <= min(max_rows, MAX_ROWS) and x.dtype in ROW_DTYPES
            and (x.is_cuda or interpreting()) and fmt in (AWQ, GPTQ) and (fmt == AWQ or in_order)
            and group_size % 32 == 0 and k % group_size == 0 and n % 8 == 0)


def config(rows: int, n: int, k: int, group_size: int, multiprocessors: int,
           tuning: KernelTuning) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, splits, num_warps).

    AWQ rows are BLOCK_N / 2 contiguous bytes: 256 columns make 128-byte rows. A [BLOCK_K, BLOCK_N]
    tile of 8K nibbles is 32 a thread at 8 warps (64 at 4): BLOCK_K 32. K is split until the launch
    has about four programs a multiprocessor (a split at least two tiles), so that every projection,
    even N 4096, keeps enough loads in flight. ``tuning.int4_gemv_block_n`` / ``int4_gemv_split_k``
    override BLOCK_N / splits."""
    block_n = tuning.int4_gemv_block_n or min(256, next_power_of_2(n))
    block_n = max(64, block_n)
    block_k = min(32, group_size)
    blocks = triton.cdiv(n, block_n)
    steps = k // block_k
    splits = tuning.int4_gemv_split_k or max(1, min(triton.cdiv(4 * multiprocessors, blocks), steps // 2))
    splits = max(1, min(splits, steps))
    return block_n, block_k, splits, 8


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
              fmt: str, bias: torch.Tensor | None = None, prologue: int = PLAIN, residual: torch.Tensor | None = None,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              tuning: KernelTuning = CUDA_TUNING) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [M, N] in x's dtype, x + residual for ADD_RMSNORM else None); ``takes`` must hold.
    x [M, K] (SILU: [M, 2K] = [gate | up]); the packed tensors as ``podium_plugin_api.int4`` lays them out."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    k, n = packed_shape(qweight, fmt)
    width = 2 * k if prologue == SILU else k
    if x.shape[1] != width:
        raise ValueError(f"int4_gemv: x is {tuple(x.shape)}; this weight [{k}, {n}] takes rows of {width}")
    summed = None
    if prologue == ADD_RMSNORM:
        if residual is None or residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"int4_gemv: the residual must match x {tuple(x.shape)} {x.dtype}")
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        summed = torch.empty_like(x)
    if prologue in (RMSNORM, ADD_RMSNORM) and (norm_weight is None or norm_weight.shape != (k,)):
        raise ValueError(f"int4_gemv: the norm's weight must be [{k}]")
    if fmt == AWQ_MMA:  # before this path's config and buffers
        return awq_mma_gemv.awq_mma_gemv(x, qweight, qzeros, scales, group_size, bias, prologue, residual,
                                         norm_weight, eps, summed, tuning), summed
    block_n, block_k, splits, warps = config(rows, n, k, group_size, _multiprocessors(x.device), tuning)
    blocks = triton.cdiv(n, block_n)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    pdl = tuning.gemv_pdl and dependent_launch(x.device)
    if awq_gemv.takes(rows, fmt == AWQ, group_size):  # splits count groups
        splits = triton.cdiv(k // group_size, triton.cdiv(k // group_size, min(splits, k // group_size)))
        partial = torch.empty((splits, n), dtype=torch.float32, device=x.device)
        awq_gemv.launch(x, qweight, qzeros, scales, group_size, bias, prologue, residual, norm_weight, eps, summed,
                        out, partial, counters(x.device, blocks) if splits > 1 else out, block_n, splits, pdl,
                        launch_options(pdl), packed=tuning.int4_gemv_packed)
        return out, summed
    per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, per_split)
    partial = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    counts = counters(x.device, blocks) if splits > 1 else out
    int4_gemv_kernel[(blocks, splits)](
        out, partial, counts, summed if summed is not None else out, qweight, qzeros, scales,
        bias if bias is not None else out, x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, rows, n, k, group_size, per_split, splits, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), float(eps), IS_AWQ=fmt == AWQ,
        BLOCK_M=next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k, NORM_BLOCK=min(2048, next_power_of_2(k)),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0, PDL=pdl, num_warps=warps,
        **launch_options(pdl),
    )
    return out, summed
