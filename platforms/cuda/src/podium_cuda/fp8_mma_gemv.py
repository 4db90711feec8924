"""FP8 W8A8 at one row on the tensor cores' warp-level MMA, the weight read as it lies in memory.

At batch-1 decode the GEMV must stream the e4m3 weight at HBM speed. On the CUDA cores every weight
byte costs a conversion and a multiply-add (fp8_gemv.py: ~2-7 instructions a byte, 2.0-2.4 TB/s on
the H200 where bf16's GEMV reaches ~4 TB/s). ``mma.sync.m16n8k32`` (sm89+) multiplies a 16 x 32
e4m3 tile by a 32 x 8 one into float32 sums: one instruction for 512 weight bytes of a warp. Its A
operand is 16 bytes a lane, four 32-bit registers: lane l (group g = l / 4, q = l % 4) holds row g
at k = 4q..4q+3 and 4q+16..4q+19, and the same columns of row g + 8. A dot product does not care in
which order its k come, as long as the weight's and x's agree, so the kernel names its own: each
lane loads 16 consecutive bytes of row g (and of row g + 8) at 16q within a 64-byte step, whose
words 0 and 1 serve as the first MMA's k sets and words 2 and 3 as the second's, and loads x's 16
bytes at the same offset for the B operands (x in every column of B, so every column of the result
is the same dot product). No shuffles, no shared memory, no conversion: a lane's step is three
16-byte loads and two MMAs for 64 weight bytes of two rows. The weight keeps the row-major [N, K]
layout ``_scaled_mm`` reads at larger batches (no second copy).

The row is quantized first (fp8_quant.quantize: the prologue, the amax and the e4m3 bytes in one
launch); this launch reads the e4m3 row and its scale. A program takes 16 output features (a row
tile) and one of ``splits`` slices of K, its warps consecutive stretches of the slice, each warp
UNROLL steps at a time with the next UNROLL steps' loads issued before the MMAs (double-buffered in
registers). The warps' sums are added in the program and scaled by ``s_w * s_x``; the slices' by the
last program of the tile (split_k.py: in split order, deterministic); then the bias.

Triton has no warp-level MMA on tensors it lays out itself, so the MMA is inline PTX over tensors
whose layout puts the right words in the right lanes: [UNROLL * 32 * WARPS, 4] int32 loads, 16
contiguous bytes a lane, give thread t the rows t, t + 32 * WARPS, ... (lane = t % 32, warp = t / 32,
one row a step in flight); ``pack=4`` hands a thread's four words of one step to one asm instance.
(test_gemv_builds checks that layout in the compiled kernel.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8_quant
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
from .split_k import counters, finish_row, last_split, reset
from .tuning import CUDA_TUNING, KernelTuning, register_cap

STEP = 64  # K bytes a warp consumes a step: two MMAs of 32
# $0-$3 the float32 sums (row g, row g, row g + 8, row g + 8), $4-$7 row g's 16 bytes, $8-$11 row g + 8's,
# $12-$15 x's 16 bytes, $16-$19 the sums so far. Words 0 and 1 of each are the first MMA's k sets, 2 and 3
# the second's (A's registers: row g low k, row g + 8 low k, row g high k, row g + 8 high k).
_MMA = "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0, $1, $2, $3}, "
_FIRST = tl.constexpr(_MMA + "{$4, $8, $5, $9}, {$12, $13}, {$16, $17, $18, $19};")
_SECOND = tl.constexpr(_MMA + "{$6, $10, $7, $11}, {$14, $15}, {$16, $17, $18, $19};")
_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 12) + ",f,f,f,f")


@triton.jit
def _mma(acc, lo, hi, xb, SECOND: tl.constexpr):
    return tl.inline_asm_elementwise(_SECOND if SECOND else _FIRST, _CONSTRAINTS, [lo, hi, xb, acc], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def fp8_mma_gemv_kernel(
    out_ptr, partial_ptr, count_ptr, w_ptr, ws_ptr, b_ptr, q_ptr, sx_ptr,
    N, K4, WORDS, splits,
    WARPS: tl.constexpr, UNROLL: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, BULK: tl.constexpr = False,
):
    """out [1, N] = (q . W^T) * s_w * s_x (+ bias); W e4m3 [N, K] seen as int32 words [N, K4], q the e4m3
    row as K4 words, s_x at sx_ptr, s_w [1] or [N]. Grid (cdiv(N, 16), splits): program (t, s) takes
    rows 16t..16t+15 over the words [s * WARPS * WORDS, (s + 1) * WARPS * WORDS), warp w the WORDS
    from s * WARPS * WORDS + w * WORDS (a multiple of 16 * UNROLL); partial float32 [splits, N]."""
    tile, split = tl.program_id(0), tl.program_id(1)
    R: tl.constexpr = 32 * WARPS
    # [UNROLL * R, 4]: element (u * R + thread, word). Two dimensions, the second the 16 contiguous bytes,
    # leave Triton one layout: 4 words a thread, the threads and warps down the first dimension in order,
    # so thread t holds rows t, t + R, ... (its UNROLL steps). A third dimension for the steps let the
    # layout's thread order depend on a tie Triton breaks differently by version (3.6 spread a warp's
    # lanes over the steps, which gave the MMAs other lanes' words).
    idx = tl.arange(0, UNROLL * R)
    thread, u = idx % R, idx // R
    lane, warp = thread % 32, thread // 32
    g, quad = lane // 4, lane % 4
    row = tile * 16 + g
    lo_row = tl.minimum(row, N - 1).to(tl.int64)  # rows past N read row N - 1 (not stored)
    hi_row = tl.minimum(row + 8, N - 1).to(tl.int64)
    start = (split * WARPS + warp) * WORDS + quad * 4  # the lane's first word in its stretch
    offs = (start + u * 16)[:, None] + tl.arange(0, 4)[None, :]  # [UNROLL * R, 4]
    lo_ptrs = w_ptr + lo_row[:, None] * K4 + offs
    hi_ptrs = w_ptr + hi_row[:, None] * K4 + offs
    x_ptrs = q_ptr + offs
    if BULK:  # each of the tile's 16 rows' stretch for this warp, whole, into L2: lane g (quad 0) rows g and g + 8
        lead = ((u == 0) & (quad == 0)).to(tl.int32)
        stretch = (split * WARPS + warp) * WORDS
        # (+ lane * 0: the size as a tensor like the address, as the asm's operands are)
        prefetch_l2_bulk(w_ptr + lo_row * K4 + stretch, WORDS * 4 + lane * 0, lead)
        prefetch_l2_bulk(w_ptr + hi_row * K4 + stretch, WORDS * 4 + lane * 0, lead)
    lo = tl.load(lo_ptrs)  # the first steps' weights do not depend on the launch before: ahead of the wait
    hi = tl.load(hi_ptrs)
    if PREFETCH:  # and the stretch's next lines into L2 while the row is quantized by the launch before
        ahead = tl.minimum(start[:, None] + 16 * UNROLL + 32 * tl.arange(0, 4)[None, :], K4 - 1)  # 128 bytes a line
        first = (u == 0).to(tl.int32)[:, None]  # a thread's UNROLL steps share these lines: its first one asks
        prefetch_l2_where(w_ptr + lo_row[:, None] * K4 + ahead, first)
        prefetch_l2_where(w_ptr + hi_row[:, None] * K4 + ahead, first)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    xb = tl.load(x_ptrs)
    acc = tl.zeros((UNROLL * R, 4), dtype=tl.float32)
    for step in range(16 * UNROLL, WORDS, 16 * UNROLL):  # the next UNROLL steps loaded before these MMAs
        lo_next = tl.load(lo_ptrs + step)
        hi_next = tl.load(hi_ptrs + step)
        xb_next = tl.load(x_ptrs + step)
        acc = _mma(acc, lo, hi, xb, False)
        acc = _mma(acc, lo, hi, xb, True)
        lo, hi, xb = lo_next, hi_next, xb_next
    acc = _mma(acc, lo, hi, xb, False)
    acc = _mma(acc, lo, hi, xb, True)
    # every column of a lane's sums is the same dot product: the first lane of each group, word 0 (row g)
    # and word 2 (row g + 8), summed over the steps in flight and the warps
    sums = tl.reshape(tl.sum(tl.reshape(acc, (UNROLL, R, 4)), 0), (WARPS, 8, 4, 4))
    q_ix = tl.arange(0, 4)[None, None, :, None]
    w_ix = tl.arange(0, 4)[None, None, None, :]
    low = tl.sum(tl.sum(tl.sum(tl.where((q_ix == 0) & (w_ix == 0), sums, 0.0), 3), 2), 0)  # [8]
    high = tl.sum(tl.sum(tl.sum(tl.where((q_ix == 0) & (w_ix == 2), sums, 0.0), 3), 2), 0)
    n_low = tile * 16 + tl.arange(0, 8)
    n_high = n_low + 8
    s_x = tl.load(sx_ptr)
    if PER_CHANNEL:
        low = low * tl.load(ws_ptr + n_low, mask=n_low < N, other=0.0)
        high = high * tl.load(ws_ptr + n_high, mask=n_high < N, other=0.0)
    else:
        low = low * tl.load(ws_ptr)
        high = high * tl.load(ws_ptr)
    low, high = low * s_x, high * s_x
    if splits == 1:
        if HAS_BIAS:
            low += tl.load(b_ptr + n_low, mask=n_low < N, other=0.0).to(tl.float32)
            high += tl.load(b_ptr + n_high, mask=n_high < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + n_low, low.to(out_ptr.dtype.element_ty), mask=n_low < N)
        tl.store(out_ptr + n_high, high.to(out_ptr.dtype.element_ty), mask=n_high < N)
    else:  # the scaled slices' sums, added in split order by the tile's last program
        part = partial_ptr + split.to(tl.int64) * N
        tl.store(part + n_low, low, mask=n_low < N)
        tl.store(part + n_high, high, mask=n_high < N)
        if last_split(count_ptr, tile, splits):
            finish_row(out_ptr, partial_ptr, b_ptr, tile * 16, N, splits, 16, HAS_BIAS)
            reset(count_ptr, tile, splits)


def takes(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, tuning: KernelTuning) -> bool:
    """Whether a call goes here: ``tuning.fp8_gemv_mma`` on, one row on an NVIDIA sm89+ GPU, a contiguous
    e4m3 weight whose K is a multiple of 64 (whole steps) at a 16-byte aligned address, per-tensor or
    per-channel scales. The alignment is what lets Triton load 16 bytes a lane, the layout the MMA's
    operands rely on (with less, the words of one asm instance would come from other lanes' rows)."""
    n, k = weight.shape
    per_row = (weight_scale.numel() == 1 and weight_scale.dim() <= 2) or tuple(weight_scale.shape) == (n, 1)
    return (tuning.fp8_gemv_mma and x.dim() == 2 and x.shape[0] == 1 and x.is_cuda
            and nvidia_at_least(x.device, (8, 9)) and per_row and weight.is_contiguous() and k % STEP == 0
            and weight.data_ptr() % 16 == 0)


def config(n: int, k: int, multiprocessors: int, tuning: KernelTuning) -> tuple[int, int, int]:
    """(warps, unroll, splits): ``tuning.fp8_mma_warps`` warps a program, ``tuning.fp8_mma_unroll`` steps
    in flight a warp (each halved while the slice would not hold a whole stretch), and the most
    splits of K up to about ``tuning.fp8_mma_programs`` programs a multiprocessor that leave every warp
    whole groups of steps."""
    steps = k // STEP
    warps, unroll = tuning.fp8_mma_warps, tuning.fp8_mma_unroll
    while warps > 1 and steps % warps:
        warps //= 2
    while unroll > 1 and (steps // warps) % unroll:
        unroll //= 2
    tiles = triton.cdiv(n, 16)
    want = max(1, triton.cdiv(tuning.fp8_mma_programs * multiprocessors, tiles))
    splits = 1
    for candidate in range(1, want + 1):
        if steps % (candidate * warps * unroll) == 0:
            splits = candidate
    return warps, unroll, splits


def fp8_mma_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 prologue: int, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                 tuning: KernelTuning = CUDA_TUNING) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [1, N] in x's dtype, x + residual for ADD_RMSNORM else None); ``takes`` must hold and the
    caller has checked the prologue's arguments (fp8_gemv.fp8_gemv)."""
    q, s_x, summed = fp8_quant.quantize(x, prologue, residual, norm_weight, eps, pdl=tuning.gemv_pdl)
    n, k = weight.shape
    warps, unroll, splits = config(n, k, _multiprocessors(x.device), tuning)
    tiles = triton.cdiv(n, 16)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    partial = torch.empty((splits, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    scale = weight_scale.reshape(-1) if weight_scale.dtype == torch.float32 else weight_scale.float().reshape(-1)
    pdl = tuning.gemv_pdl and dependent_launch(x.device)
    fp8_mma_gemv_kernel[(tiles, splits)](
        out, partial, counters(x.device, tiles) if splits > 1 else out, weight.view(torch.int32), scale,
        bias if bias is not None else out, q.view(torch.int32), s_x, n, k // 4, k // 4 // (splits * warps), splits,
        WARPS=warps, UNROLL=unroll, PER_CHANNEL=weight_scale.numel() != 1, HAS_BIAS=bias is not None, PDL=pdl,
        PREFETCH=tuning.fp8_mma_prefetch, BULK=tuning.fp8_mma_bulk_prefetch and nvidia_at_least(x.device, (9, 0)),
        num_warps=warps, num_stages=1, **launch_options(pdl), **register_cap(tuning.fp8_mma_maxnreg),
    )
    return out, summed
