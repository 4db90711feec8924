"""The one-row AWQ GEMV (a batch-1 decode step's INT4 projections), the case the INT4 speed target is about.

int4_gemv.py's kernel unpacks a tile into [rows, words, 8 nibbles]; Triton then spreads the nibble
axis over threads and routes every word through shared memory, and each thread multiplies one
column: about ten instructions a weight. Here every tensor stays in the layout the packed words are
loaded in: a thread is two int32 words (16 columns) of one row of a [SUB, BLOCK_N / 8] sub-tile (a
warp reads 64 consecutive words, 256 bytes, of a row), and the eight nibbles of a word are eight
separate accumulators, so nothing is reshaped. Per weight (``_nibble``):

    LOP3  word & (exponent bits | 15 << 4e): the float 2^23 + q * 16^e exactly, the word having had
          2^23's exponent bits OR-ed in once (its low five nibbles; the top three shifted down by 20)
    FADD  minus 2^23 + z * 16^e (the group's zero, unpacked the same way once a group): (q - z) 16^e
    FFMA  times x into the group's sum for that column

and once a group, per column: sum * (s * 16^-e) into the total (exact powers of two). A group is
GROUP // SUB sub-tiles unrolled, one 8-byte load of each in flight per thread; the first group's lines
are requested for L2 at the start (``prefetch_l2``), before the wait for the previous kernel. The prologue's output
for the program's rows is computed once into a float32 scratch (every thread of a warp needs the
same rows). A program owns BLOCK_N columns and a slice of the groups (split-K as in split_k.py: the
last program of a column block adds the slices' partial sums in order and writes the row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait, nvidia_at_least, prefetch_l2
from .prologue import input_chunk, rows_rstd
from .split_k import finish_row, last_split, reset

SUB = 16  # rows of a sub-tile: one row a thread (a thread is two words of a row)
_SUB = tl.constexpr(SUB)
MAGIC = 0x4B000000  # the float 2^23's bits: OR-ing 23 bits below them gives 2^23 + those bits, exactly


@triton.jit
def _halves(words, magic):
    """(low, high): the low five nibbles of each word, and the top three shifted down by 20, each with
    2^23's exponent bits (``magic``) above them, so that one AND keeps a nibble and the exponent.
    ``magic`` is a kernel argument, not a literal, so that the compiler cannot fold the OR into every
    nibble's AND (which then needs two constants, one in a register, per instruction)."""
    return (words & 0xFFFFF) | magic, ((words >> 20) & 0xFFF) | magic


@triton.jit
def _nibble(low, high, NIB: tl.constexpr):
    """2^23 + q_I * 16^e as float32 (e = NIB for NIB < 5, else NIB - 5) from ``_halves``."""
    if NIB < 5:
        v = low & (0x7F800000 | (15 << (4 * NIB)))
    else:
        v = high & (0x7F800000 | (15 << (4 * (NIB - 5))))
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _unscale(NIB: tl.constexpr):
    """16^-e of nibble NIB (_nibble's factor)."""
    if NIB < 5:
        f = 1.0 / (1 << (4 * NIB))
    else:
        f = 1.0 / (1 << (4 * (NIB - 5)))
    return f


@triton.jit
def _scale(s_ptr, g, N, words, ok, NIB: tl.constexpr, EVEN_N: tl.constexpr):
    """The group's scale of nibble NIB's columns (8 word + AWQ_ORDER[NIB]) times 16^-e, [BW] float32."""
    order = (NIB % 4) * 2 + NIB // 4  # AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
    ptrs = s_ptr + g * N + 8 * words + order
    s = tl.load(ptrs) if EVEN_N else tl.load(ptrs, mask=ok, other=0.0)
    return s.to(tl.float32) * _unscale(NIB)


@triton.jit
def _load(qw_ptr, tile, k0, N, ok, EVEN_N: tl.constexpr):
    """The [_SUB, BW] words of rows k0 .. k0 + _SUB (a scalar row pointer plus the tile's int32 offsets)."""
    rows = qw_ptr + k0.to(tl.int64) * (N // 8)
    if EVEN_N:
        w = tl.load(rows + tile)
    else:
        w = tl.load(rows + tile, mask=ok[None, :], other=0)
    return w


@triton.jit
def _store_nibble(ptr, words, ok, value, NIB: tl.constexpr):
    tl.store(ptr + 8 * words + (NIB % 4) * 2 + NIB // 4, value, mask=ok)


@triton.jit(do_not_specialize=["one", "magic"])
def awq_gemv_kernel(
    out_ptr, partial_ptr, count_ptr, sum_ptr, h_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, x_ptr, r_ptr, g_ptr,
    N, K, groups_per_split, splits, eps, one, magic,
    BLOCK_N: tl.constexpr, GROUP: tl.constexpr, NORM_BLOCK: tl.constexpr, PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """out [1, N] = prologue(x) [1, K] @ W (+ bias), W AWQ-packed (qweight [K, N/8]). Grid (cdiv(N, BLOCK_N),
    splits); split s takes groups [s * groups_per_split, ...)."""
    BW: tl.constexpr = BLOCK_N // 8
    pid_n, split = tl.program_id(0), tl.program_id(1)
    # one == 1, unknown to the compiler: it then proves pairs of words contiguous (the hint), no more, so a
    # thread loads two words (8 bytes) of a row and a warp 64 words
    words = tl.max_contiguous(tl.multiple_of(pid_n * BW + tl.arange(0, BW) * one, 2), 2)
    ok = words < N // 8
    sub_rows = tl.arange(0, _SUB)
    g_first = split * groups_per_split
    g_end = tl.minimum(K // GROUP, g_first + groups_per_split)
    tile = sub_rows[:, None] * (N // 8) + words[None, :]  # [_SUB, BW] int32 offsets from a sub-tile's first row
    if PREFETCH:  # the first group's lines to L2 while the prologue runs (a row of BLOCK_N / 8 words: one line)
        prefetch_l2(qw_ptr + (g_first * GROUP + tl.arange(0, GROUP)).to(tl.int64) * (N // 8) + pid_n * BW)
    w0 = _load(qw_ptr, tile, g_first * GROUP, N, ok, EVEN_N)  # each group's first sub-tile, loaded a group ahead
    if PDL:  # a sub-tile is in flight; everything below reads what earlier kernels write
        gdc_launch_dependents()
        gdc_wait()
    row = tl.zeros([1, 1], dtype=tl.int32)
    rstd = tl.sum(tl.sum(rows_rstd(x_ptr + row, r_ptr + row, sum_ptr + row, row == 0, K, eps, pid_n + split,
                                   PROLOGUE, NORM_BLOCK), 1), 0)
    # The prologue's output for this split's rows, once, to h (float32 [K], L2): every thread of a warp
    # multiplies the same rows (a thread is one word of them), so computing it in the loop would repeat
    # each element's norm or SiLU 32 times. Programs of other column blocks write the same values.
    for h0 in range(g_first * GROUP, g_end * GROUP, NORM_BLOCK):
        cols = h0 + tl.arange(0, NORM_BLOCK)
        in_split = cols < g_end * GROUP
        tl.store(h_ptr + cols, input_chunk(x_ptr, r_ptr, g_ptr, rstd, cols, in_split, K, PROLOGUE), mask=in_split)
    tl.debug_barrier()  # this program's stores before its threads read each other's
    zero = tl.zeros([_SUB, BW], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero  # totals, per nibble
    for g in range(g_first, g_end):
        zw = (tl.load(qz_ptr + g * (N // 8) + words) if EVEN_N else
              tl.load(qz_ptr + g * (N // 8) + words, mask=ok, other=0))[None, :]
        zl, zh = _halves(zw, magic)
        z0, z1, z2, z3 = _nibble(zl, zh, 0), _nibble(zl, zh, 1), _nibble(zl, zh, 2), _nibble(zl, zh, 3)
        z4, z5, z6, z7 = _nibble(zl, zh, 4), _nibble(zl, zh, 5), _nibble(zl, zh, 6), _nibble(zl, zh, 7)
        c0, c1, c2, c3, c4, c5, c6, c7 = zero, zero, zero, zero, zero, zero, zero, zero  # this group's sums
        for t in tl.static_range(GROUP // _SUB):
            k0 = g * GROUP + t * _SUB
            if t == 0:
                w = w0
            else:
                w = _load(qw_ptr, tile, k0, N, ok, EVEN_N)
            if t == GROUP // _SUB - 1:  # the next group's (this one's again at the end: in bounds, unused)
                w0 = _load(qw_ptr, tile, tl.minimum(g + 1, g_end - 1) * GROUP, N, ok, EVEN_N)
            x = tl.load(h_ptr + k0 + sub_rows)[:, None]
            lo, hi = _halves(w, magic)
            c0 += x * (_nibble(lo, hi, 0) - z0)
            c1 += x * (_nibble(lo, hi, 1) - z1)
            c2 += x * (_nibble(lo, hi, 2) - z2)
            c3 += x * (_nibble(lo, hi, 3) - z3)
            c4 += x * (_nibble(lo, hi, 4) - z4)
            c5 += x * (_nibble(lo, hi, 5) - z5)
            c6 += x * (_nibble(lo, hi, 6) - z6)
            c7 += x * (_nibble(lo, hi, 7) - z7)
        a0 += c0 * _scale(s_ptr, g, N, words, ok, 0, EVEN_N)[None, :]
        a1 += c1 * _scale(s_ptr, g, N, words, ok, 1, EVEN_N)[None, :]
        a2 += c2 * _scale(s_ptr, g, N, words, ok, 2, EVEN_N)[None, :]
        a3 += c3 * _scale(s_ptr, g, N, words, ok, 3, EVEN_N)[None, :]
        a4 += c4 * _scale(s_ptr, g, N, words, ok, 4, EVEN_N)[None, :]
        a5 += c5 * _scale(s_ptr, g, N, words, ok, 5, EVEN_N)[None, :]
        a6 += c6 * _scale(s_ptr, g, N, words, ok, 6, EVEN_N)[None, :]
        a7 += c7 * _scale(s_ptr, g, N, words, ok, 7, EVEN_N)[None, :]
    dest = partial_ptr + split.to(tl.int64) * N
    _store_nibble(dest, words, ok, tl.sum(a0, 0), 0)
    _store_nibble(dest, words, ok, tl.sum(a1, 0), 1)
    _store_nibble(dest, words, ok, tl.sum(a2, 0), 2)
    _store_nibble(dest, words, ok, tl.sum(a3, 0), 3)
    _store_nibble(dest, words, ok, tl.sum(a4, 0), 4)
    _store_nibble(dest, words, ok, tl.sum(a5, 0), 5)
    _store_nibble(dest, words, ok, tl.sum(a6, 0), 6)
    _store_nibble(dest, words, ok, tl.sum(a7, 0), 7)
    if last_split(count_ptr, pid_n, splits):
        finish_row(out_ptr, partial_ptr, b_ptr, pid_n * BLOCK_N, N, splits, BLOCK_N, HAS_BIAS)
        reset(count_ptr, pid_n, splits)


def takes(rows: int, fmt_is_awq: bool, group_size: int) -> bool:
    return rows == 1 and fmt_is_awq and group_size % SUB == 0


def launch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
           bias, prologue: int, residual, norm_weight, eps: float, summed, out: torch.Tensor, partial: torch.Tensor,
           counts, block_n: int, splits: int, pdl: bool, launch_options: dict) -> None:
    """One launch over ``splits`` slices of the groups (int4_gemv.int4_gemv allocates and picks): partial is
    float32 [splits, N] (one split too), counts the column blocks' zeroed counters."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = k // group_size
    per_split = triton.cdiv(groups, splits)
    awq_gemv_kernel[(triton.cdiv(n, block_n), splits)](
        out, partial, counts, summed if summed is not None else out, torch.empty(k, dtype=torch.float32, device=x.device),
        qweight, qzeros, scales,
        bias if bias is not None else out, x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, n, k, per_split, splits, float(eps), 1, MAGIC, BLOCK_N=block_n,
        GROUP=group_size, NORM_BLOCK=min(2048, triton.next_power_of_2(k)), PROLOGUE=prologue,
        HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0, PDL=pdl, PREFETCH=nvidia_at_least(x.device, (8, 0)),
        num_warps=warps(block_n), **launch_options)


def warps(block_n: int) -> int:
    """Two words of one sub-tile row a thread: SUB rows x BLOCK_N / 16 word pairs."""
    return max(1, SUB * block_n // 512)
