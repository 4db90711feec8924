"""One AWQ row on the tensor cores' warp MMA, the weight repacked into the MMA's fragment order (Marlin-style).

awq_gemv.py multiplies every nibble on the CUDA cores: ~2.4 SASS instructions a weight in its packed
half-precision form, ~4.7 in float32, and ~0.6-0.8 TB/s of packed weight at one row on an H100.
``mma.sync.m16n8k16`` f16 multiplies a 16 x 16 tile by a 16 x 8 one into float32 sums; its A operand
is four f16 pairs a lane: lane l (g = l / 4, q = l % 4) holds row g at k slots (2q, 2q + 1) and
(2q + 8, 2q + 9), and the same slots of row g + 8. The contract's AWQ_MMA layout (``awq_to_mma``, which
``convert_model`` applies to a model's AWQ weights in place) lays the weight out so that one
32-bit word of a lane holds exactly those eight nibbles of a 16-output x 16-k tile (W^T as A, x in
every column of B), in the order two masks take them apart:

    nibbles 0, 4  row g,     k slots 2q, 2q + 1       a0 = word      & 0x000F000F | 0x64006400
    nibbles 1, 5  row g + 8, k slots 2q, 2q + 1       a1 = word      & 0x00F000F0 | 0x64006400
    nibbles 2, 6  row g,     k slots 2q + 8, 2q + 9   a2 = word >> 8 & 0x000F000F | 0x64006400
    nibbles 3, 7  row g + 8, k slots 2q + 8, 2q + 9   a3 = word >> 8 & 0x00F000F0 | 0x64006400

(LOP3 each: the f16 pair 1024 + q, exactly, or 1024 + 16 q for row g + 8, whose sums are 16 times
too large and scaled back once a group). A dot product does not care which k a slot stands for as
long as A's and B's agree, so lane q's slots in a 64-k super-step of four MMAs are the 16 contiguous
k from 64 s + 16 q: its x (f16) is 32 contiguous bytes, its weight 16 (the four MMAs' words), each
a 16-byte load, and a warp's 32 lanes read a super-step's 512 weight bytes of one 16-output tile in
one pass. Per lane and MMA: one shift, four LOP3 and the MMA for 8 weights (~0.8 instructions a
weight, the loads included).

The zero is not subtracted per nibble: a group's MMA chain starts from -(1024 + z) X (row g + 8:
-(1024 + 16 z) X), X the sum of the group's x as the MMA multiplies them, so it ends at sum (q - z) x
(16 times for row g + 8), which the group's scale multiplies into the total. The f32 chain holds
terms of ~1024 |x|, so its rounding is ~2^-24 of 1024 sum |x| a group: ~1e-4 of the result, well under
a bf16 output's 2^-9.

x is the prologue's output (prologue.py; RMSNorm / add-RMSNorm / SiLU-and-mul), computed by one launch
before (``prepare``: rounded to x's dtype as the separate kernel rounds it, then to f16 after the power
of two that puts its largest |x| in [2^14, 2^15), which the GEMV undoes at the end: bf16 rows past
f16's range and rows of tiny values keep f16's 11 bits) together with the groups' sums. A program takes 16 outputs (a tile) and one of ``splits`` slices of the groups, its
warps consecutive stretches of whole groups, a group's super-steps in flight at once and the next
group's loads issued before this group's MMAs. With ``KernelTuning.int4_mma_groups`` > 1 a warp takes
that many groups an iteration (a chunk, at most four super-steps), their scales, zeros and x sums
loaded with the weights a chunk ahead: more bytes in flight a warp, where one group keeps 1 KiB in
flight and loads its scales and zeros in the loop beside the MMAs that use them (but 218 registers a
thread instead of 80: a third of the warps resident). ``int4_mma_prefetch`` has each warp ask L2 for its
whole stretch of weights and its groups' scale and zero lines first (one bulk prefetch, no registers
held), and ``int4_mma_ahead`` off loads a group's operands in its own iteration (56 registers): the
levers Nsight Compute points to, the warps stalled on memory for most of their cycles. The warps' sums are
added in the program, the slices' by the last program of the tile (split_k.py: in split order,
deterministic), then the bias.

The CUDA platform converts a model's AWQ weights when it prepares the model (``KernelTuning.int4_gemv_mma``,
``convert_model``); the converted weight replaces the checkpoint's layout, which only the GPU's kernels
would have read: int4.py's GEMM reads AWQ_MMA for more rows, and the contract's reference reads it too.
Like fp8_mma_gemv.py the MMA is inline PTX over [R, 4] tensors that Triton lays out four words a
thread, the threads down the rows in order (test_gemv_builds checks the compiled layout). Under Triton's
interpreter, which runs no PTX, ``_emulated`` computes the four MMAs from the same words by the fragment
layout, so that the rest of the kernel (offsets, the groups' loop, the zero and scale terms, the splits)
is tested on a CPU too (TRITON_INTERPRET=1 with numpy < 2.4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from podium_plugin_api.int4 import AWQ, AWQ_MMA, awq_to_mma, packed_shape

from .awq_gemv import _f16_halves
from .fp8_gemm import interpreting
from .gemv import _multiprocessors
from .pdl import (
    dependent_launch,
    gdc_launch_dependents,
    gdc_wait,
    launch_options,
    nvidia_at_least,
    prefetch_l2_bulk,
    prefetch_l2_where,
)
from .prologue import input_chunk, rows_rstd
from .split_k import counters, finish_row, last_split, reset
from .tuning import CUDA_TUNING, KernelTuning, next_power_of_2, register_cap

STEP_K = 64  # k a super-step: four MMAs of 16
MAX_ROWS = 8  # B's columns: one x row each
F16_LIMIT_EXP = tl.constexpr(15)  # x is scaled by a power of two to just below 2^15 before the f16 rounding

# $0-$3 the f32 sums (row g twice, row g + 8 twice), $4-$7 the four MMAs' weight words, $8-$15 x's eight
# words (two an MMA), $16-$19 the sums so far
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
_SUPER_STEP = tl.constexpr("{\n.reg .b32 a0, a1, a2, a3, t;\n" + "".join(
    f"shr.b32 t, ${4 + u}, 8;\n"
    f"lop3.b32 a0, ${4 + u}, 0x000F000F, 0x64006400, 0xEA;\n"
    f"lop3.b32 a1, ${4 + u}, 0x00F000F0, 0x64006400, 0xEA;\n"
    "lop3.b32 a2, t, 0x000F000F, 0x64006400, 0xEA;\n"
    "lop3.b32 a3, t, 0x00F000F0, 0x64006400, 0xEA;\n"
    f"{_MMA} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{${8 + 2 * u}, ${9 + 2 * u}}}, "
    + ("{$16, $17, $18, $19};\n" if u == 0 else "{$0, $1, $2, $3};\n")
    for u in range(4)) + "}")
_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 12) + ",f,f,f,f")


@triton.jit
def _super_step(acc, w, x_lo, x_hi, HW_ASM: tl.constexpr):
    """acc + the four MMAs of a super-step (w: the lane's four words, x_lo / x_hi: its eight x words). Under
    Triton's interpreter, which runs no PTX, ``_emulated`` computes the same sums from the same words."""
    if HW_ASM:
        return tl.inline_asm_elementwise(_SUPER_STEP, _CONSTRAINTS, [w, x_lo, x_hi, acc], dtype=tl.float32,
                                         is_pure=True, pack=4)
    return acc + _emulated(w, x_lo, x_hi)


@triton.jit
def _column(t, j: tl.constexpr):
    """Column j of a [M, 4] tensor, [M]."""
    return tl.sum(tl.where(tl.arange(0, 4)[None, :] == j, t, 0), 1)


@triton.jit
def _pair_dot(a, b):
    """The f16 pairs a . b (int32 bits each) in float32: lo * lo + hi * hi."""
    a_lo, a_hi = _f16_halves(a)
    b_lo, b_hi = _f16_halves(b)
    return a_lo * b_lo + a_hi * b_hi


@triton.jit
def _lanes(t, L: tl.constexpr):
    """[L * 32] (element L' * 32 + 4 g + q) -> [L, 8, 4] (g, q): a warp's lanes by their MMA group and quad."""
    return tl.reshape(t, (L, 8, 4))


@triton.jit
def _emulated(w, x_lo, x_hi):
    """The four MMAs' sums by the PTX fragment layout, in plain Triton (the interpreter's stand-in for the asm;
    slow on a GPU). Lane (g, q) holds A's rows g and g + 8 at its slots and B's column g (x row g) at the same
    slots; C[row][col] sums over the quad's lanes q the products of lane (row, q)'s A and lane (col, q)'s B,
    and lane (g, q) receives C[g][2q], C[g][2q + 1], C[g + 8][2q], C[g + 8][2q + 1]."""
    M: tl.constexpr = w.shape[0]
    L: tl.constexpr = M // 32
    low = tl.zeros((L, 8, 8), dtype=tl.float32)  # [., row g, col c]
    high = tl.zeros((L, 8, 8), dtype=tl.float32)
    for u in tl.static_range(4):
        word = _column(w, u)
        shifted = word >> 8
        xs = x_lo if u < 2 else x_hi
        b0, b1 = _lanes(_column(xs, 2 * (u % 2)), L)[:, None, :, :], _lanes(_column(xs, 2 * (u % 2) + 1), L)[:, None, :, :]
        a0 = _lanes((word & 0x000F000F) | 0x64006400, L)[:, :, None, :]
        a1 = _lanes((word & 0x00F000F0) | 0x64006400, L)[:, :, None, :]
        a2 = _lanes((shifted & 0x000F000F) | 0x64006400, L)[:, :, None, :]
        a3 = _lanes((shifted & 0x00F000F0) | 0x64006400, L)[:, :, None, :]
        low += tl.sum(_pair_dot(a0, b0) + _pair_dot(a2, b1), 3)
        high += tl.sum(_pair_dot(a1, b0) + _pair_dot(a3, b1), 3)
    # [., g, c = 2 q + i] -> lane (g, q)'s pair i
    low0, low1 = tl.split(tl.reshape(low, (M, 2)))
    high0, high1 = tl.split(tl.reshape(high, (M, 2)))
    return _four(low0, low1, high0, high1)


@triton.jit
def _four(low0, low1, high0, high1):
    """[M] each -> [M, 4] (low0, low1, high0, high1): values for a lane's four MMA sums (C[g][2q],
    C[g][2q + 1], C[g + 8][2q], C[g + 8][2q + 1]), joined in registers. A join's new dimension is the last
    one: element [m, i, o] of join(join(low0, high0), join(low1, high1)) is (low, high)[i] of column o,
    so [m, 2 i + o] runs low0, low1, high0, high1."""
    return tl.reshape(tl.join(tl.join(low0, high0), tl.join(low1, high1)), (low0.shape[0], 4))


@triton.jit
def prepare_kernel(h_ptr, xs_ptr, up_ptr, sum_ptr, x_ptr, r_ptr, g_ptr, K, eps, stride_x, stride_r,
                   GROUP: tl.constexpr, BLOCK: tl.constexpr, PROLOGUE: tl.constexpr, PDL: tl.constexpr):
    """Row m (program m) of h [M, K] f16 = prologue(x) (rounded to x's dtype) times ``down``, the power of two
    that puts the row's max |h| in [2^14, 2^15); of xs [M, K / GROUP] float32, each group's sum of those f16
    values; up [M] = 1 / down. ``sum`` (ADD_RMSNORM's x + residual) is [M, K] contiguous."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    one = tl.zeros([1, 1], dtype=tl.int64)
    x_rows, r_rows = x_ptr + m * stride_x + one, r_ptr + m * stride_r + one
    h_ptr += m * K
    xs_ptr += m * (K // GROUP)
    row_ok = one == 0
    rstd = rows_rstd(x_rows, r_rows, sum_ptr + m * K + one, row_ok, K, eps, 0, PROLOGUE, BLOCK)
    amax = tl.zeros([1, 1], dtype=tl.float32)
    for c0 in range(0, K, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        h = input_chunk(x_rows, r_rows, g_ptr, rstd, cols, row_ok & (cols < K), K, PROLOGUE)
        amax = tl.maximum(amax, tl.max(tl.abs(h), 1, keep_dims=True))
    # 2^(141 - biased) brings amax into [2^14, 2^15) from either side (amax in [2^(biased - 127), 2^(biased - 126))):
    # a row of small values is scaled up, so that f16 keeps their 11 bits instead of going subnormal
    biased = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 254)  # both stay normal
    shift = (127 + F16_LIMIT_EXP - 1) - biased
    down = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    up = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    for c0 in range(0, K, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        ok = row_ok & (cols < K)
        h = (input_chunk(x_rows, r_rows, g_ptr, rstd, cols, ok, K, PROLOGUE) * down).to(tl.float16)
        tl.store(h_ptr + cols, h, mask=ok)
        sums = tl.sum(tl.reshape(h.to(tl.float32), (BLOCK // GROUP, GROUP)), 1)
        groups = c0 // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(xs_ptr + groups, sums, mask=groups < K // GROUP)
    tl.store(up_ptr + m + one, up)


@triton.jit
def _operands(w_ptrs, x_ptrs, i, x_ok, GROUP_STEPS: tl.constexpr):
    """The MMAs' operands from group i on of a warp's (a chunk): the weight words and the x words (the lane's
    eight, two an MMA). The pointers are the first chunk's; a group on is a fixed step."""
    w = tl.load(w_ptrs + i * GROUP_STEPS * 128)
    x_lo = tl.load(x_ptrs + i * GROUP_STEPS * 32, mask=x_ok, other=0)
    x_hi = tl.load(x_ptrs + (i * GROUP_STEPS * 32 + 4), mask=x_ok, other=0)
    return w, x_lo, x_hi


@triton.jit
def _terms(z_ptr, s_ptr, xs_ptr, group, feature, first, col0, col1, groups, N, M, ONE_ROW: tl.constexpr):
    """Each element's group terms (``group``: its group, a tensor): the zeros and scales of rows g and g + 8
    (columns c and c + 8 share a qzeros word) and the groups' sums of the x rows that a lane's sums take
    (only in a group's first super-step: one chain carries the zero term; one row: one sum for all four)."""
    z_low = tl.load(z_ptr + group * (N // 8) + feature // 8)
    z_high = tl.load(z_ptr + group * (N // 8) + feature // 8 + 1)
    s_low = tl.load(s_ptr + group * N + feature)
    s_high = tl.load(s_ptr + group * N + feature + 8)
    if ONE_ROW:
        sum0 = tl.where(first, tl.load(xs_ptr + group), 0.0)
        sum1 = sum0
    else:
        sum0 = tl.load(xs_ptr + col0 * groups + group, mask=first & (col0 < M), other=0.0)
        sum1 = tl.load(xs_ptr + col1 * groups + group, mask=first & (col1 < M), other=0.0)
    return z_low, z_high, s_low, s_high, sum0, sum1


@triton.jit
def awq_mma_gemv_kernel(
    out_ptr, partial_ptr, count_ptr, w_ptr, s_ptr, z_ptr, b_ptr, h_ptr, xs_ptr, up_ptr,
    M, N, SUPER_STEPS, GROUPS_PER_WARP, splits,
    WARPS: tl.constexpr, GROUP_STEPS: tl.constexpr, CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr, HW_ASM: tl.constexpr, ONE_ROW: tl.constexpr, PREFETCH: tl.constexpr = False,
    AHEAD: tl.constexpr = True,
):
    """out [M, N] = h . W (+ bias), M <= 8: W in AWQ_MMA's order ([N / 16, K / 64, 32, 4] int32), scales
    [K / G, N] float32 and AWQ qzeros [K / G, N / 8] as stored, h the f16 rows as int32 words [M, K / 2],
    xs their groups' sums [M, K / G], up their scales back [M]. Row m of h is column m of B (lanes of MMA
    group g = m load it; the other columns are zeros), so C[feature][m] is the row's output. Grid
    (N / 16, splits): warp w of program (t, s) takes outputs 16t..16t+15 over the groups from
    (s * WARPS + w) * GROUPS_PER_WARP (a multiple of CHUNK), CHUNK groups of GROUP_STEPS = G / 64
    super-steps at a time (every one of a chunk's super-steps in flight at once), the next chunk's
    loads issued before this chunk's MMAs. Split: partial [M, splits, N].
    ONE_ROW (M = 1, batch-1 decode): every lane loads the row, so every column of C is its output, and a
    group's zero term is one product a row of A: the loop's per-group work as small as it can be."""
    tile, split = tl.program_id(0), tl.program_id(1)
    R: tl.constexpr = 32 * WARPS
    UNROLL: tl.constexpr = GROUP_STEPS * CHUNK  # super-steps a thread has in flight
    idx = tl.arange(0, UNROLL * R)  # element (u * R + thread, word): two dimensions, one layout (fp8_mma_gemv)
    thread, u = idx % R, idx // R
    lane, warp = thread % 32, thread // 32
    g, quad = lane // 4, lane % 4
    j = tl.arange(0, 4)[None, :]
    groups = SUPER_STEPS // GROUP_STEPS
    # a group's scale and zero of rows g and g + 8 are loaded a thread's [UNROLL * R] and joined into its
    # four sums' places (_four): gathers shaped [UNROLL * R, 4] get a layout of their own, and operands of
    # another layout change the MMAs' (Triton 3.6 then spreads a thread's four sums over other rows)
    feature = tile * 16 + g  # row g's output; row g + 8's is 8 on (the same qzeros word)
    z_shift = (feature % 2) * 16 + ((feature % 8) // 2) * 4  # AWQ_ORDER's nibble of the column
    first_group = (split * WARPS + warp) * GROUPS_PER_WARP  # [UNROLL * R]
    group = first_group + u // GROUP_STEPS  # each element's group in the first chunk
    first = u % GROUP_STEPS == 0  # a group's zero term goes into one of its chains
    step = first_group * GROUP_STEPS + u  # the super-step each element's thread starts on
    w_offs = (((tile * SUPER_STEPS + step) * 32 + lane) * 4).to(tl.int64)[:, None] + j
    # x row g as int32 words: 32 a super-step, 8 a lane; rows past M are B's zero columns
    x_offs = ((0 if ONE_ROW else g * (SUPER_STEPS * 32)) + step * 32 + quad * 8)[:, None] + j
    x_ok = (g < M)[:, None] | ONE_ROW
    col0, col1 = 2 * quad, 2 * quad + 1  # the x rows (B's columns) of a lane's sums
    w_ptrs = w_ptr + w_offs
    x_ptrs = h_ptr + x_offs
    if PREFETCH:  # the warp's whole stretch of weights (one bulk request) and its groups' scale and zero lines
        lead = ((u == 0) & (lane == 0)).to(tl.int32)
        stretch = (tile.to(tl.int64) * SUPER_STEPS + first_group * GROUP_STEPS) * 128  # its first word
        # (+ lane * 0: the size as a tensor like the address, as the asm's operands are)
        prefetch_l2_bulk(w_ptr + stretch, GROUPS_PER_WARP * GROUP_STEPS * 512 + lane * 0, lead)
        mine = ((u == 0) & (lane < GROUPS_PER_WARP)).to(tl.int32)  # lane l: the warp's group l
        prefetch_l2_where(s_ptr + (first_group + lane) * N + tile * 16, mine)
        prefetch_l2_where(z_ptr + (first_group + lane) * (N // 8) + tile * 2, mine)
    w = tl.load(w_ptrs)  # the first chunk's weights do not depend on the launch before
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    x_lo = tl.load(x_ptrs, mask=x_ok, other=0)
    x_hi = tl.load(x_ptrs + 4, mask=x_ok, other=0)
    if CHUNK > 1:
        z_low, z_high, s_low, s_high, sum0, sum1 = _terms(z_ptr, s_ptr, xs_ptr, group, feature, first, col0, col1,
                                                          groups, N, M, ONE_ROW)
    total = tl.zeros((UNROLL * R, 4), dtype=tl.float32)
    for i in range(0, GROUPS_PER_WARP, CHUNK):
        if not AHEAD:  # this chunk's operands loaded here (the first before the loop): fewer registers a thread
            if i > 0:
                w, x_lo, x_hi = _operands(w_ptrs, x_ptrs, i, x_ok, GROUP_STEPS)
        elif i + CHUNK < GROUPS_PER_WARP:  # the next chunk's loads before this chunk's MMAs
            w_n, x_lo_n, x_hi_n = _operands(w_ptrs, x_ptrs, i + CHUNK, x_ok, GROUP_STEPS)
            if CHUNK > 1:  # and its terms
                z_low_n, z_high_n, s_low_n, s_high_n, sum0_n, sum1_n = _terms(
                    z_ptr, s_ptr, xs_ptr, group + i + CHUNK, feature, first, col0, col1, groups, N, M, ONE_ROW)
        else:
            w_n, x_lo_n, x_hi_n = w, x_lo, x_hi
            if CHUNK > 1:
                z_low_n, z_high_n, s_low_n, s_high_n, sum0_n, sum1_n = z_low, z_high, s_low, s_high, sum0, sum1
        if CHUNK == 1:  # one group an iteration: its terms loaded beside its MMAs (fewer registers carried)
            z_low, z_high, s_low, s_high, sum0, sum1 = _terms(z_ptr, s_ptr, xs_ptr, group + i, feature, first, col0,
                                                              col1, groups, N, M, ONE_ROW)
        zero_low = -(1024.0 + ((z_low >> z_shift) & 15).to(tl.float32))
        zero_high = -(1024.0 + 16.0 * ((z_high >> z_shift) & 15).to(tl.float32))
        start = _four(zero_low * sum0, zero_low * sum1, zero_high * sum0, zero_high * sum1)
        s_high_16 = s_high * (1.0 / 16)  # row g + 8's sums are 16 times too large
        scale = _four(s_low, s_low, s_high_16, s_high_16)
        acc = _super_step(tl.zeros((UNROLL * R, 4), dtype=tl.float32), w, x_lo, x_hi, HW_ASM)
        total += (acc + start) * scale
        if AHEAD:
            w, x_lo, x_hi = w_n, x_lo_n, x_hi_n
        if CHUNK > 1 and AHEAD:
            z_low, z_high, s_low, s_high, sum0, sum1 = z_low_n, z_high_n, s_low_n, s_high_n, sum0_n, sum1_n
    # lane (g, q)'s word j is C[feature g + 8 (j // 2)][x row 2 q + j % 2]: summed over the super-steps in
    # flight and the warps
    sums = tl.reshape(tl.sum(tl.reshape(total, (UNROLL, R, 4)), 0), (WARPS, 8, 4, 4))  # [warp, g, q, j]
    g_ix = tl.arange(0, 8)[:, None, None]
    q_ix = tl.arange(0, 4)[None, :, None]
    j_ix = tl.arange(0, 4)[None, None, :]
    if ONE_ROW:  # C[.][0] alone, words 0 and 2 of lanes q = 0, picked before the warps' sum: words 1 and 3
        # are then never computed
        low = tl.sum(tl.sum(tl.sum(tl.where((q_ix == 0) & (j_ix == 0), sums, 0.0), 3), 2), 0)
        high = tl.sum(tl.sum(tl.sum(tl.where((q_ix == 0) & (j_ix == 2), sums, 0.0), 3), 2), 0)
        sums = tl.join(low, high)  # [g, feature g or g + 8]
        row = tl.zeros([1, 1], dtype=tl.int32)
        cols = tile * 16 + tl.arange(0, 8)[:, None] + 8 * tl.arange(0, 2)[None, :]
    else:
        sums = tl.sum(sums, 0)  # [g, q, j]
        row = 2 * q_ix + j_ix % 2
        cols = tile * 16 + g_ix + 8 * (j_ix // 2)
    row_ok = row < M
    sums *= tl.load(up_ptr + row, mask=row_ok, other=0.0)
    if splits == 1:
        if HAS_BIAS:
            sums += tl.load(b_ptr + cols).to(tl.float32)
        tl.store(out_ptr + row * N + cols, sums.to(out_ptr.dtype.element_ty), mask=row_ok)
    else:
        tl.store(partial_ptr + (row * splits + split).to(tl.int64) * N + cols, sums, mask=row_ok)
        if last_split(count_ptr, tile, splits):
            for m in range(0, M):
                finish_row(out_ptr + m * N, partial_ptr + m * splits * N, b_ptr, tile * 16, N, splits, 16, HAS_BIAS)
            reset(count_ptr, tile, splits)


CONVERT_COLUMNS = 2048  # columns converted at a time: the unpacked nibbles (int64) of K x 2048 at most


def convert_model(model: torch.nn.Module, columns: int = CONVERT_COLUMNS) -> int:
    """Every AWQ layer this kernel takes (on a CUDA device or under the interpreter, a weight that ``fits``)
    converted in place to AWQ_MMA: its qweight replaced by the same nibbles in the MMA's order, ``columns``
    (a multiple of 16) at a time (the checkpoint's layout is freed: the weight memory stays the packed
    size), its format renamed so that every op reads it as such (int4.py's GEMM for more rows, the
    contract's reference); the count."""
    made = 0
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if (getattr(module, "format", None) == AWQ and isinstance(qweight, torch.Tensor)
                and (qweight.is_cuda or interpreting())
                and fits(*packed_shape(qweight, AWQ), getattr(module, "group_size", 0))):
            step = columns // 8
            words = [awq_to_mma(qweight[:, c:c + step]) for c in range(0, qweight.shape[1], step)]
            module.qweight = torch.nn.Parameter(torch.cat(words), requires_grad=False)
            module.format = AWQ_MMA
            made += 1
    return made


def fits(k: int, n: int, group_size: int) -> bool:
    """The weight shapes the kernel takes: groups of 64, 128 or 256 (whole super-steps, at most four in
    flight), N a multiple of 16 (whole tiles)."""
    return group_size in (64, 128, 256) and k % group_size == 0 and n % 16 == 0


def takes(x: torch.Tensor, n: int, k: int, group_size: int, max_rows: int = MAX_ROWS) -> bool:
    """Whether an AWQ_MMA call goes here: 1..min(max_rows, MAX_ROWS) f16 / bf16 rows on an NVIDIA sm80+ GPU (or
    Triton's interpreter: ``_emulated``), a weight that ``fits``. float32 rows do not (x goes in as f16):
    int4.py's GEMM takes them."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= min(max_rows, MAX_ROWS)
            and ((x.is_cuda and nvidia_at_least(x.device, (8, 0))) or interpreting())
            and x.dtype in (torch.float16, torch.bfloat16) and fits(k, n, group_size))


def config(n: int, k: int, group_size: int, multiprocessors: int, tuning: KernelTuning) -> tuple[int, int, int]:
    """(warps, splits, chunk): ``tuning.int4_mma_warps`` warps a program (halved while the groups do not divide
    among them), the most splits of the groups up to about ``tuning.int4_mma_programs`` programs a
    multiprocessor that leave every warp whole groups, and ``tuning.int4_mma_groups`` groups a warp loads
    at a time (halved while they do not divide a warp's groups or would put more than four super-steps
    in flight a thread: its registers)."""
    groups = k // group_size
    warps = tuning.int4_mma_warps
    while warps > 1 and groups % warps:
        warps //= 2
    want = max(1, triton.cdiv(tuning.int4_mma_programs * multiprocessors, n // 16))
    splits = 1
    for candidate in range(1, want + 1):
        if groups % (candidate * warps) == 0:
            splits = candidate
    chunk = next_power_of_2(max(1, tuning.int4_mma_groups))
    while chunk > 1 and ((groups // (warps * splits)) % chunk or chunk * group_size > 4 * STEP_K):
        chunk //= 2
    return warps, splits, chunk


def prepare(x: torch.Tensor, k: int, group_size: int, prologue: int, residual: torch.Tensor | None,
            norm_weight: torch.Tensor | None, eps: float, summed: torch.Tensor | None,
            pdl: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h f16 [M, K], the groups' sums float32 [M, K / G], up float32 [M]) of x's M rows (``prepare_kernel``,
    a program a row)."""
    rows = x.shape[0]
    h = torch.empty((rows, k), dtype=torch.float16, device=x.device)
    sums = torch.empty((rows, k // group_size), dtype=torch.float32, device=x.device)
    up = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = max(group_size, min(4096, next_power_of_2(k)))
    prepare_kernel[(rows,)](h, sums, up, summed if summed is not None else x, x,
                            residual if residual is not None else x, norm_weight if norm_weight is not None else x,
                            k, float(eps), x.stride(0), residual.stride(0) if residual is not None else 0,
                            GROUP=group_size, BLOCK=block, PROLOGUE=prologue, PDL=pdl,
                            num_warps=max(4, min(block // 256, 16)), **launch_options(pdl))
    return h, sums, up


def awq_mma_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, prologue: int, residual: torch.Tensor | None,
                 norm_weight: torch.Tensor | None, eps: float, summed: torch.Tensor | None,
                 tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """out [M, N] in x's dtype (``summed``, given for ADD_RMSNORM, receives x + residual) of an AWQ_MMA weight;
    ``takes`` must hold and the caller has checked the prologue's arguments (int4_gemv.int4_gemv)."""
    k, n = packed_shape(qweight, AWQ_MMA)
    if not 1 <= x.shape[0] <= MAX_ROWS:  # B has 8 columns: a ninth row would be dropped, not computed
        raise ValueError(f"awq_mma_gemv takes 1 to {MAX_ROWS} rows, not {x.shape[0]} (int4.py's GEMM takes more)")
    pdl = tuning.gemv_pdl and dependent_launch(x.device)
    h, sums, up = prepare(x, k, group_size, prologue, residual, norm_weight, eps, summed, pdl)
    warps, splits, chunk = config(n, k, group_size, _multiprocessors(x.device), tuning)
    tiles = n // 16
    rows = x.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    partial = torch.empty((rows, splits, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    scale = scales if scales.dtype == torch.float32 and scales.is_contiguous() else scales.float().contiguous()
    awq_mma_gemv_kernel[(tiles, splits)](
        out, partial, counters(x.device, tiles) if splits > 1 else out, qweight, scale, qzeros,
        bias if bias is not None else out, h.view(torch.int32), sums, up, rows, n, k // STEP_K,
        k // group_size // (splits * warps), splits, WARPS=warps, GROUP_STEPS=group_size // STEP_K, CHUNK=chunk,
        HAS_BIAS=bias is not None, PDL=pdl, HW_ASM=not interpreting(), ONE_ROW=rows == 1,
        PREFETCH=tuning.int4_mma_prefetch and nvidia_at_least(x.device, (9, 0)), AHEAD=tuning.int4_mma_ahead or chunk > 1,
        num_warps=warps, num_stages=1,
        **launch_options(pdl), **register_cap(tuning.int4_mma_maxnreg),
    )
    return out

