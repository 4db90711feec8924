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

PACKED (``KernelTuning.int4_gemv_packed``): two columns an instruction in half precision, ~1.6
instructions a weight against ~5 (sm90 builds compared; the float32 steps above leave the GEMV
bound by them, ~0.8 TB/s of packed weight at one row). Per word (``_pairs_fma``, inline PTX):

    LOP3   (word >> 8s) & 0x000F000F << 4j | 0x64006400: the f16 pair 1024 + q * 16^j of nibbles
           (2s + j, 2s + j + 4), j, s in {0, 1}: four pairs a word (one shift)
    HSUB2  minus the zero's pair, unpacked the same way once a group: (q - z) * 16^j, exact
    HFMA2  times x's pair (x, x) into the pair's f16 sum over the group's GROUP / SUB rows

and once a group the f16 sums go to float32 and take the scale. x is scaled by a power of two per
program (from its slice's largest |x|) so that a group's sum stays below f16's 65504 (at most
GROUP / SUB products of 240 * |x|, 2^EXP); only the group's f16 sums round (11 bits). Under
Triton's interpreter, which runs no PTX, ``_pairs_fma`` computes the same in float32 rounded to f16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_gemm import interpreting
from .pdl import gdc_launch_dependents, gdc_wait, nvidia_at_least, prefetch_l2
from .prologue import input_chunk, rows_rstd
from .split_k import finish_row, last_split, reset

SUB = 16  # rows of a sub-tile: one row a thread (a thread is two words of a row)
PACKED_SUB = 8  # PACKED: twice the rows a thread a group, half the per-group work (scales, f16 -> float32) a weight
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
def _f16_halves(bits):
    """The f16 pair in int32 ``bits`` as float32 (low, high)."""
    lo = (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _f16_pair(lo, hi):
    """float32 (lo, hi) rounded to f16, packed into int32 bits."""
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo_bits | (hi_bits << 16)


@triton.jit
def _nibble_pair(words, P: tl.constexpr):
    """Pair P (0..3) of each word as f16 bits: 1024 + q * 16^(P % 2) of nibbles (P // 2 * 2 + P % 2, + 4)."""
    shifted = words >> (8 * (P // 2))
    return (shifted & (0x000F000F << (4 * (P % 2)))) | 0x64006400


@triton.jit
def _zero_pairs(zwords):
    return _nibble_pair(zwords, 0), _nibble_pair(zwords, 1), _nibble_pair(zwords, 2), _nibble_pair(zwords, 3)


@triton.jit
def _pairs_fma(w, xx, z0, z1, z2, z3, p0, p1, p2, p3, HW_ASM: tl.constexpr):
    """p_P + (pair P of w - z_P) * xx for the four pairs, f16x2 in int32 bits (module docstring)."""
    if HW_ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, h;
            shr.b32 h, $4, 8;
            lop3.b32 t, $4, 0x000F000F, 0x64006400, 0xEA;
            sub.rn.f16x2 t, t, $6;
            fma.rn.f16x2 $0, t, $5, $10;
            lop3.b32 t, $4, 0x00F000F0, 0x64006400, 0xEA;
            sub.rn.f16x2 t, t, $7;
            fma.rn.f16x2 $1, t, $5, $11;
            lop3.b32 t, h, 0x000F000F, 0x64006400, 0xEA;
            sub.rn.f16x2 t, t, $8;
            fma.rn.f16x2 $2, t, $5, $12;
            lop3.b32 t, h, 0x00F000F0, 0x64006400, 0xEA;
            sub.rn.f16x2 t, t, $9;
            fma.rn.f16x2 $3, t, $5, $13;
            }""",
            "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
            [w, xx, z0, z1, z2, z3, p0, p1, p2, p3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
            pack=1)
    return (_pair_fma(_nibble_pair(w, 0), z0, xx, p0), _pair_fma(_nibble_pair(w, 1), z1, xx, p1),
            _pair_fma(_nibble_pair(w, 2), z2, xx, p2), _pair_fma(_nibble_pair(w, 3), z3, xx, p3))


@triton.jit
def _pair_fma(q, z, xx, acc):
    """fma.rn.f16x2(q - z, xx, acc) in float32, rounded to f16 (the products are exact in float32)."""
    q_lo, q_hi = _f16_halves(q)
    z_lo, z_hi = _f16_halves(z)
    x_lo, x_hi = _f16_halves(xx)
    a_lo, a_hi = _f16_halves(acc)
    return _f16_pair((q_lo - z_lo) * x_lo + a_lo, (q_hi - z_hi) * x_hi + a_hi)


@triton.jit
def _packed_sums(pairs, P: tl.constexpr):
    """Pair P's f16 sums as float32 (nibble P // 2 * 2 + P % 2, nibble + 4), the 16^(P % 2) undone."""
    lo, hi = _f16_halves(pairs)
    if P % 2 == 1:
        lo, hi = lo * (1.0 / 16), hi * (1.0 / 16)
    return lo, hi


@triton.jit
def _scale(s_ptr, g, N, words, ok, NIB: tl.constexpr, EVEN_N: tl.constexpr, PACKED: tl.constexpr):
    """The group's scale of nibble NIB's columns (8 word + AWQ_ORDER[NIB]), [BW] float32, times 16^-e
    (not PACKED: _nibble's factor; packed sums come unscaled from _packed_sums)."""
    order = (NIB % 4) * 2 + NIB // 4  # AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
    ptrs = s_ptr + g * N + 8 * words + order
    s = tl.load(ptrs) if EVEN_N else tl.load(ptrs, mask=ok, other=0.0)
    if PACKED:
        return s.to(tl.float32)
    return s.to(tl.float32) * _unscale(NIB)


@triton.jit
def _load(qw_ptr, tile, k0, N, ok, EVEN_N: tl.constexpr):
    """The [SUB_ROWS, BW] words of rows k0.. (a scalar row pointer plus the tile's int32 offsets)."""
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
    PACKED: tl.constexpr, HW_ASM: tl.constexpr, EXP: tl.constexpr, SUB_ROWS: tl.constexpr,
):
    """out [1, N] = prologue(x) [1, K] @ W (+ bias), W AWQ-packed (qweight [K, N/8]). Grid (cdiv(N, BLOCK_N),
    splits); split s takes groups [s * groups_per_split, ...)."""
    BW: tl.constexpr = BLOCK_N // 8
    pid_n, split = tl.program_id(0), tl.program_id(1)
    # one == 1, unknown to the compiler: it then proves pairs of words contiguous (the hint), no more, so a
    # thread loads two words (8 bytes) of a row and a warp 64 words
    words = tl.max_contiguous(tl.multiple_of(pid_n * BW + tl.arange(0, BW) * one, 2), 2)
    ok = words < N // 8
    sub_rows = tl.arange(0, SUB_ROWS)
    g_first = split * groups_per_split
    g_end = tl.minimum(K // GROUP, g_first + groups_per_split)
    tile = sub_rows[:, None] * (N // 8) + words[None, :]  # [SUB_ROWS, BW] int32 offsets from a sub-tile's first row
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
    amax = tl.max(tl.zeros([NORM_BLOCK], dtype=tl.float32), 0)
    for h0 in range(g_first * GROUP, g_end * GROUP, NORM_BLOCK):
        cols = h0 + tl.arange(0, NORM_BLOCK)
        in_split = cols < g_end * GROUP
        h = input_chunk(x_ptr, r_ptr, g_ptr, rstd, cols, in_split, K, PROLOGUE)
        tl.store(h_ptr + cols, h, mask=in_split)
        if PACKED:
            amax = tl.maximum(amax, tl.max(tl.abs(h), 0))
    tl.debug_barrier()  # this program's stores before its threads read each other's
    # PACKED: x times 2^-e into [2^(EXP-1), 2^EXP) at the slice's largest |x|, and 2^e back at the end
    # (powers of two built from amax's exponent bits, clamped so both stay normal floats)
    biased = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, EXP)
    x_down = ((253 + EXP - biased) << 23).to(tl.float32, bitcast=True)
    x_up = ((biased - EXP + 1) << 23).to(tl.float32, bitcast=True)
    zero = tl.zeros([SUB_ROWS, BW], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero  # totals, per nibble
    for g in range(g_first, g_end):
        zw = (tl.load(qz_ptr + g * (N // 8) + words) if EVEN_N else
              tl.load(qz_ptr + g * (N // 8) + words, mask=ok, other=0))[None, :]
        zl, zh = _halves(zw, magic)
        z0, z1, z2, z3 = _nibble(zl, zh, 0), _nibble(zl, zh, 1), _nibble(zl, zh, 2), _nibble(zl, zh, 3)
        z4, z5, z6, z7 = _nibble(zl, zh, 4), _nibble(zl, zh, 5), _nibble(zl, zh, 6), _nibble(zl, zh, 7)
        c0, c1, c2, c3, c4, c5, c6, c7 = zero, zero, zero, zero, zero, zero, zero, zero  # this group's sums
        if PACKED:
            q0, q1, q2, q3 = _zero_pairs(zw)
            blank = tl.zeros([SUB_ROWS, BW], dtype=tl.int32)  # f16 +0 pairs
            p0, p1, p2, p3 = blank, blank, blank, blank
        for t in tl.static_range(GROUP // SUB_ROWS):
            k0 = g * GROUP + t * SUB_ROWS
            if t == 0:
                w = w0
            else:
                w = _load(qw_ptr, tile, k0, N, ok, EVEN_N)
            if t == GROUP // SUB_ROWS - 1:  # the next group's (this one's again at the end: in bounds, unused)
                w0 = _load(qw_ptr, tile, tl.minimum(g + 1, g_end - 1) * GROUP, N, ok, EVEN_N)
            x = tl.load(h_ptr + k0 + sub_rows)[:, None]
            if PACKED:
                xx = _f16_pair(x * x_down, x * x_down)
                p0, p1, p2, p3 = _pairs_fma(w, xx, q0, q1, q2, q3, p0, p1, p2, p3, HW_ASM)
            else:
                lo, hi = _halves(w, magic)
                c0 += x * (_nibble(lo, hi, 0) - z0)
                c1 += x * (_nibble(lo, hi, 1) - z1)
                c2 += x * (_nibble(lo, hi, 2) - z2)
                c3 += x * (_nibble(lo, hi, 3) - z3)
                c4 += x * (_nibble(lo, hi, 4) - z4)
                c5 += x * (_nibble(lo, hi, 5) - z5)
                c6 += x * (_nibble(lo, hi, 6) - z6)
                c7 += x * (_nibble(lo, hi, 7) - z7)
        if PACKED:  # pair P holds nibbles (P // 2 * 2 + P % 2, + 4)
            c0, c4 = _packed_sums(p0, 0)
            c1, c5 = _packed_sums(p1, 1)
            c2, c6 = _packed_sums(p2, 2)
            c3, c7 = _packed_sums(p3, 3)
        a0 += c0 * _scale(s_ptr, g, N, words, ok, 0, EVEN_N, PACKED)[None, :]
        a1 += c1 * _scale(s_ptr, g, N, words, ok, 1, EVEN_N, PACKED)[None, :]
        a2 += c2 * _scale(s_ptr, g, N, words, ok, 2, EVEN_N, PACKED)[None, :]
        a3 += c3 * _scale(s_ptr, g, N, words, ok, 3, EVEN_N, PACKED)[None, :]
        a4 += c4 * _scale(s_ptr, g, N, words, ok, 4, EVEN_N, PACKED)[None, :]
        a5 += c5 * _scale(s_ptr, g, N, words, ok, 5, EVEN_N, PACKED)[None, :]
        a6 += c6 * _scale(s_ptr, g, N, words, ok, 6, EVEN_N, PACKED)[None, :]
        a7 += c7 * _scale(s_ptr, g, N, words, ok, 7, EVEN_N, PACKED)[None, :]
    if PACKED:
        a0, a1, a2, a3, a4, a5, a6, a7 = (a0 * x_up, a1 * x_up, a2 * x_up, a3 * x_up, a4 * x_up, a5 * x_up,
                                          a6 * x_up, a7 * x_up)
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
           counts, block_n: int, splits: int, pdl: bool, launch_options: dict, packed: bool = False) -> None:
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
        PACKED=packed, HW_ASM=not interpreting(), EXP=packed_exponent(group_size), SUB_ROWS=sub_rows(packed),
        num_warps=warps(block_n, packed), **launch_options)


def packed_exponent(group_size: int) -> int:
    """PACKED: x is scaled below 2^EXP so that a group's f16 sum, GROUP / SUB products of at most
    240 * 2^EXP (a nibble difference times 16), stays below 65504: 2^5 at 8 rows a thread, halved
    for every doubling beyond."""
    chain = max(1, group_size // sub_rows(True))
    return 5 - max(0, chain.bit_length() - 4)


def sub_rows(packed: bool) -> int:
    return PACKED_SUB if packed else SUB


def warps(block_n: int, packed: bool = False) -> int:
    """Two words of one sub-tile row a thread: sub-tile rows x BLOCK_N / 16 word pairs."""
    return max(1, sub_rows(packed) * block_n // 512)
