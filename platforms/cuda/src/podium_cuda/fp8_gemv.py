"""FP8 W8A8 (``podium_plugin_api.fp8``) at a few rows: a GEMV over the e4m3 weight with the activations'
per-token quantization, and the norm or SiLU-and-mul before it (prologue.py), inside the one launch.

At batch-1 decode ``_scaled_mm`` and the launches that quantize its input cost more than bf16's
GEMV (docs/performance.md), though the weight is half the bytes. The work per weight byte must stay
small, and quantizing an input element (prologue, a correctly rounded division, the e4m3 rounding)
costs a few dozen instructions: so a program owns a slice of K (BLOCK_K wide, ``split`` of them)
and a range of output features, quantizes its rows' slice once into registers, and then streams the
range's weight rows past it, ROWS at a time, each [ROWS, BLOCK_K] tile's products summed into the
slice's partial dot products. Each element is thus quantized by one program per feature range
(not one per feature tile), and a weight element costs its conversion and one FMA.

The rows' scales need the whole row: every program walks the rows' K for their norm (``rows_rstd``)
and their amax (``rows_scale``), reads from L2. The slices' partial sums (float32 scratch) are added
by the last program of each feature range to finish (an atomic count per range, reset by it), in
split order (deterministic), scaled by ``s_x * s_w``, the bias added, the row written: one launch.
The quantized values are the bytes ``quantize_per_token`` gives (IEEE division).

PDL (sm90+): the kernel lets the next one launch at its start and waits for the one before it first;
the first weight tile's lines are requested for L2 before that wait (``prefetch_l2``), so HBM streams
them while the previous kernel ends and the rows' norm and amax are computed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8_mma_gemv, fp8_quant
from .fp8_gemm import interpreting
from .fp8_quant import e4m3_values, rows_scale
from .gemv import _multiprocessors
from .pdl import dependent_launch, gdc_launch_dependents, gdc_wait, launch_options, nvidia_at_least, prefetch_l2
from .prologue import ADD_RMSNORM, PLAIN, RMSNORM, SILU, input_chunk, rows_rstd
from .split_k import counters, last_split, reset
from .tuning import CUDA_TUNING, KernelTuning, next_power_of_2

MAX_ROWS = 16  # the most input rows a launch takes (the MMA's rows; on the CUDA cores each row's slice is in registers)
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _tile(w_ptr, n0, n_end, k, k_ok, K, TILE: tl.constexpr):
    """The e4m3 weight rows n0 .. n0 + TILE (masked at n_end) at columns k, [TILE, BLOCK_K]."""
    n = n0 + tl.arange(0, TILE)
    return tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=(n < n_end)[:, None] & k_ok[None, :],
                   other=0.0)


@triton.jit
def fp8_gemv_kernel(
    out_ptr, partial_ptr, count_ptr, sum_ptr, w_ptr, ws_ptr, b_ptr, x_ptr, r_ptr, g_ptr,
    M, N, K, features, splits, stride_x, stride_r, stride_o, eps,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TILE: tl.constexpr, NORM_BLOCK: tl.constexpr,
    PROLOGUE: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
    XQ_GIVEN: tl.constexpr, HW_CAST: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    PACKED: tl.constexpr, EVEN_K: tl.constexpr, BITS: tl.constexpr,
):
    """out [M, N] = (e4m3(prologue(x) / s_x) . W^T) * s_x * s_w (+ bias); W e4m3 [N, K] row-major, s_w [1] or
    [N]. Grid (cdiv(N, features), splits): program (f, s) takes features [f * features, ...) over
    columns [s * BLOCK_K, ...); partial is float32 [splits, M, N]. TILE weight rows a step, multiplied on
    the CUDA cores (products and a sum over the slice) or, DOT, on the tensor cores as an MMA of the
    slice's rows padded to 16 (one row: broadcast) with the tile. XQ_GIVEN: x holds the rows already
    quantized (e4m3, no prologue) and r their scales. PACKED (one row, CUDA cores): ``_packed_steps``, or with
    BITS (whole slices only) ``_bits_steps``."""
    pid_f, split = tl.program_id(0), tl.program_id(1)
    n_start = pid_f * features
    n_end = tl.minimum(N, n_start + features)
    k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    if PREFETCH:  # the first tile's lines to L2 while the rows' norm and amax are computed (clamped in bounds)
        lines = tl.minimum(split * BLOCK_K + 128 * tl.arange(0, BLOCK_K // 128), K - 1)
        first = tl.minimum(n_start + tl.arange(0, TILE), N - 1)
        prefetch_l2(w_ptr + first.to(tl.int64)[:, None] * K + lines[None, :])
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rows = tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64) * stride_x
    r_rows = r_ptr + rows.to(tl.int64) * stride_r
    if PACKED:  # the slice as [BLOCK_K / 512, 1, 32, 16] (_packed_steps' layout)
        kx = split * BLOCK_K + (tl.arange(0, BLOCK_K // 512)[:, None, None, None] * 512
                                + tl.arange(0, 32)[None, None, :, None] * 16 + tl.arange(0, 16)[None, None, None, :])
        kx_ok = kx < K
    else:
        kx, kx_ok = k[None, :], k_ok[None, :]  # [1, BLOCK_K]
    if XQ_GIVEN:  # x is e4m3 already (fp8_quant.quantize), its rows' scales at r_ptr
        xq = tl.load(x_rows + kx, mask=row_ok & kx_ok, other=0.0).to(tl.float32)
        s_x = tl.load(r_ptr + rows, mask=row_ok, other=1.0)
    else:
        rstd = rows_rstd(x_rows, r_rows, sum_ptr + rows.to(tl.int64) * K, row_ok, K, eps, pid_f + split, PROLOGUE,
                         NORM_BLOCK)
        s_x = rows_scale(x_rows, r_rows, g_ptr, rstd, row_ok, K, PROLOGUE, NORM_BLOCK)  # [BLOCK_M, 1]
        h = input_chunk(x_rows, r_rows, g_ptr, rstd, kx, row_ok & kx_ok, K, PROLOGUE)
        xq = e4m3_values(tl.math.div_rn(h, s_x), HW_CAST)  # this slice, quantized once
    if PACKED and BITS:
        _bits_steps(partial_ptr, w_ptr, xq, n_start, n_end, K, N, split, BLOCK_K, TILE, HW_CAST)
    elif PACKED:
        _packed_steps(partial_ptr, w_ptr, xq, n_start, n_end, kx, kx_ok, K, N, split, BLOCK_K, TILE, EVEN_K)
    elif DOT:
        _dot_steps(partial_ptr, w_ptr, xq, n_start, n_end, k, k_ok, K, M, N, split, BLOCK_M, BLOCK_K, TILE, HW_CAST)
    else:
        part_rows = partial_ptr + (split * M + rows).to(tl.int64) * N  # [BLOCK_M, 1]
        w = _tile(w_ptr, n_start, n_end, k, k_ok, K, TILE)
        for n0 in range(n_start, n_end, TILE):
            w_next = _tile(w_ptr, n0 + TILE, n_end, k, k_ok, K, TILE)  # a tile ahead (masked off past the range)
            wf = w.to(tl.float32)
            n = n0 + tl.arange(0, TILE)
            if BLOCK_M == 1:
                part = tl.sum(wf * xq, 1)[None, :]  # [1, TILE]
            else:
                part = tl.sum(wf[None, :, :] * xq[:, None, :], 2)  # [BLOCK_M, TILE]
            tl.store(part_rows + n[None, :], part, mask=row_ok & (n < n_end)[None, :])
            w = w_next
    if last_split(count_ptr, pid_f, splits):
        _finish(out_ptr, partial_ptr, ws_ptr, b_ptr, s_x, rows, row_ok, n_start, n_end, M, N, splits, stride_o,
                PER_CHANNEL, HAS_BIAS)
        reset(count_ptr, pid_f, splits)


@triton.jit
def _packed_steps(partial_ptr, w_ptr, xq, n_start, n_end, k, k_ok, K, N, split, BLOCK_K: tl.constexpr,
                  TILE: tl.constexpr, EVEN_K: tl.constexpr):
    """One row on the CUDA cores at about two instructions a weight byte (the plain steps take ~7: a
    float32 conversion, multiply and add an element, and a cross-warp sum every 16 weight rows).

    The slice is [BLOCK_K / 512, 1, 32, 16]: a warp's 32 lanes each take 16 consecutive bytes of every
    512, so a step of TILE weight rows (one a warp) is 16-byte loads, and a row's sum stays inside
    its warp (one shuffle tree a row, after the lane has added its BLOCK_K / 32 products). Products
    are half precision, two a packed instruction: e4m3 pairs convert to f16x2 in one instruction and
    e4m3 x e4m3 is exact in f16 (8 significant bits); x is scaled by 2^-8 so that 16 products (at
    most 448 * 1.75 each) sum below f16's 65504, and only those 16-term sums round to f16 (11
    bits) before the float32 sums. e4m3 subnormal x subnormal products (< 2^-24 after the scaling)
    are lost: ~1e-9 of the largest product. Loads are unmasked where the slices are whole (EVEN_K;
    rows past the range load the range's last row again, not stored): a masked byte load merges its
    "other" value byte by byte (~1.3 PRMT a weight byte in the sm90 build)."""
    x16 = (xq * (1.0 / 256)).to(tl.float16)  # exact: e4m3 values times a power of two
    rows = tl.arange(0, TILE)[None, :, None, None]
    n_rows = tl.arange(0, TILE)
    part_row = partial_ptr + split.to(tl.int64) * N
    for n0 in range(n_start, n_end, TILE):
        w = _rows(w_ptr, n0 + rows, n_end, k, k_ok, K, EVEN_K)  # [REPS, TILE, 32, 16]
        chunk = tl.sum(w.to(tl.float16) * x16, 3).to(tl.float32)  # [REPS, TILE, 32]: 16 products each
        part = tl.sum(tl.sum(chunk, 0), 1) * 256.0  # [TILE]
        tl.store(part_row + n0 + n_rows, part, mask=n0 + n_rows < n_end)


@triton.jit
def _bits_steps(partial_ptr, w_ptr, xq, n_start, n_end, K, N, split, BLOCK_K: tl.constexpr, TILE: tl.constexpr,
                HW_ASM: tl.constexpr):
    """``_packed_steps`` with the e4m3 -> f16 conversion done by integer instructions instead of the
    conversion unit (``cvt.rn.f16x2.e4m3x2``, one a weight pair), in case that unit is what bounds the
    one-row GEMV: the slice's words as [BLOCK_K / 512, TILE, 32, 4] int32 (a lane's 16 bytes of every
    512), each word's four bytes as two f16 pairs by masks and shifts, (b1, b3) = sign | (magnitude >> 1)
    in place and (b0, b2) the same from the word shifted left by 8: each the e4m3 value times 2^-8 exactly,
    subnormals too (e4m3's exponent bias 7 against f16's 15), so x is not scaled. A word's four products
    are two f16 pairs (HMUL2, HFMA2: each half two exact products, rounded once or twice) added in
    float32: ~3.6 instructions a weight byte in place of ~1.7 (sm90 build), none of them conversions.
    Whole slices only (K a multiple of BLOCK_K: the launcher takes ``_packed_steps`` otherwise)."""
    REPS: tl.constexpr = BLOCK_K // 512
    # x's pairs, [REPS, 1, 32, 4]: column 4j + 2p + q of a lane's 16 at [..., j, p, q]
    x_even, x_odd = tl.split(tl.reshape(xq, (REPS, 1, 32, 4, 2, 2)))  # q = 0 / 1: [..., j, p]
    x0, x2 = tl.split(x_even)
    x1, x3 = tl.split(x_odd)
    x02, x13 = _f16_bits(x0, x2), _f16_bits(x1, x3)
    words = (split * (BLOCK_K // 4) + tl.arange(0, REPS)[:, None, None, None] * 128
             + tl.arange(0, 32)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :])
    w_words = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    rows = tl.arange(0, TILE)[None, :, None, None]
    n_rows = tl.arange(0, TILE)
    part_row = partial_ptr + split.to(tl.int64) * N
    for n0 in range(n_start, n_end, TILE):
        n = tl.minimum(n0 + rows, n_end - 1)  # rows past the range load its last row again, not stored
        w = tl.load(w_words + n.to(tl.int64) * (K // 4) + words)  # [REPS, TILE, 32, 4]
        dots = _word_dots(w, x0, x1, x2, x3, x02, x13, HW_ASM)
        part = tl.sum(tl.sum(tl.sum(dots, 3), 0), 1) * 256.0  # [TILE], the 2^-8 undone
        tl.store(part_row + n0 + n_rows, part, mask=n0 + n_rows < n_end)


@triton.jit
def _f16_bits(lo, hi):
    """float32 (lo, hi), exact in f16, as an f16 pair's bits (lo in the low half)."""
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo_bits | (hi_bits << 16)


@triton.jit
def _e4m3_pair(v):
    """The e4m3 bytes 1 and 3 of int32 words v as an f16 pair (their values times 2^-8)."""
    return ((v & 0x7F007F00) >> 1) | (v & -0x7FFF8000)  # -0x7FFF8000: 0x80008000 as an int32


@triton.jit
def _half(bits, HIGH: tl.constexpr):
    """The low or high f16 of int32 bits as float32."""
    h = (bits >> 16) if HIGH else (bits & 0xFFFF)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_dots(w, x0, x1, x2, x3, x02, x13, HW_ASM: tl.constexpr):
    """x0 e(b0) + x1 e(b1) + x2 e(b2) + x3 e(b3) of each word's bytes b, float32 (the sum times 2^-8):
    (b1, b3) and (b0, b2) as f16 pairs, HMUL2 by (x1, x3), HFMA2 by (x0, x2), the halves added in
    float32. Under the interpreter the same in float32 with f16 roundings."""
    if HW_ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 ra, rb, rt, rp;
            .reg .b16 hl, hh;
            .reg .f32 fl, fh;
            and.b32 rt, $1, 0x7F007F00;
            shr.b32 rt, rt, 1;
            and.b32 ra, $1, 0x80008000;
            or.b32 ra, ra, rt;
            shl.b32 rb, $1, 8;
            and.b32 rt, rb, 0x7F007F00;
            shr.b32 rt, rt, 1;
            and.b32 rb, rb, 0x80008000;
            or.b32 rb, rb, rt;
            mul.rn.f16x2 rp, ra, $3;
            fma.rn.f16x2 rp, rb, $2, rp;
            mov.b32 {hl, hh}, rp;
            cvt.f32.f16 fl, hl;
            cvt.f32.f16 fh, hh;
            add.f32 $0, fl, fh;
            }""",
            "=f,r,r,r", [w, x02, x13], dtype=tl.float32, is_pure=True, pack=1)
    a, b = _e4m3_pair(w), _e4m3_pair(w << 8)
    lo = (_half(a, False) * x1).to(tl.float16).to(tl.float32)  # exact products, as HMUL2's
    hi = (_half(a, True) * x3).to(tl.float16).to(tl.float32)
    lo = (_half(b, False) * x0 + lo).to(tl.float16).to(tl.float32)  # one rounding, as HFMA2's
    hi = (_half(b, True) * x2 + hi).to(tl.float16).to(tl.float32)
    return lo + hi


@triton.jit
def _rows(w_ptr, n, n_end, k, k_ok, K, EVEN_K: tl.constexpr):
    """The weight rows n (clamped into the range) at columns k."""
    ptrs = w_ptr + tl.minimum(n, n_end - 1).to(tl.int64) * K + k
    if EVEN_K:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=k_ok, other=0.0)
    return w


@triton.jit
def _dot_steps(partial_ptr, w_ptr, xq, n_start, n_end, k, k_ok, K, M, N, split, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr, TILE: tl.constexpr, HW_CAST: tl.constexpr):
    """The feature range's partial sums through tl.dot: [16, BLOCK_K] x [BLOCK_K, TILE] a step."""
    if BLOCK_M == 1:
        a = tl.broadcast_to(xq, (16, BLOCK_K))  # rows 1..15 repeat row 0 and are not stored
    else:
        a = xq  # BLOCK_M == 16, rows past M zero (XQ_GIVEN)
    rows = tl.arange(0, 16)[:, None]
    part_rows = partial_ptr + (split * M + rows).to(tl.int64) * N
    for n0 in range(n_start, n_end, TILE):
        w = _tile(w_ptr, n0, n_end, k, k_ok, K, TILE)
        if HW_CAST:
            part = tl.dot(a.to(tl.float8e4nv), tl.trans(w), out_dtype=tl.float32)
        else:  # the interpreter: the same exact products in float32
            part = tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="ieee")
        n = n0 + tl.arange(0, TILE)
        tl.store(part_rows + n[None, :], part, mask=(rows < M) & (n < n_end)[None, :])


@triton.jit
def _finish(out_ptr, partial_ptr, ws_ptr, b_ptr, s_x, rows, row_ok, n_start, n_end, M, N, splits, stride_o,
            PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[:, n_start:n_end] = (sum over splits of partial) * s_x * s_w (+ bias), splits in order."""
    for c0 in range(n_start, n_end, 128):
        n = c0 + tl.arange(0, 128)[None, :]
        ok = row_ok & (n < n_end)
        total = tl.zeros((rows.shape[0], 128), dtype=tl.float32)
        for s in range(0, splits):
            total += tl.load(partial_ptr + (s * M + rows).to(tl.int64) * N + n, mask=ok, other=0.0,
                             cache_modifier=".cg")
        s_w = tl.load(ws_ptr + n, mask=n < n_end, other=0.0) if PER_CHANNEL else tl.load(ws_ptr)
        total = total * s_w * s_x
        if HAS_BIAS:
            total += tl.load(b_ptr + n, mask=n < n_end, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows.to(tl.int64) * stride_o + n, total.to(out_ptr.dtype.element_ty), mask=ok)


def takes(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, max_rows: int) -> bool:
    """Whether a call with input rows ``x`` [M, width] goes here: 1..min(max_rows, MAX_ROWS) rows of a
    float dtype on the device (or the interpreter), a contiguous e4m3 weight with per-tensor or
    per-channel scales."""
    n = weight.shape[0]
    per_row = weight_scale.numel() == 1 or tuple(weight_scale.shape) == (n, 1)
    return (x.dim() == 2 and 1 <= x.shape[0] <= min(max_rows, MAX_ROWS) and x.dtype in ROW_DTYPES
            and (x.is_cuda or interpreting()) and per_row and weight.is_contiguous())


def config(rows: int, n: int, k: int, multiprocessors: int, tuning: KernelTuning) -> tuple[int, int, int, int]:
    """(BLOCK_K, TILE, features a program, num_warps). Tensor cores (``tuning.fp8_gemv_dot``): slices of 512
    columns and 128 weight rows a step (the fewest instructions a weight byte of the sm90 builds
    compared: ~2 against ~7 on the CUDA cores); CUDA cores: 512 columns (a warp's 16-byte loads span
    one row of it; 256 with more than two input rows, all held in registers) and 16 rows a step;
    packed (``packed``: one row): K up to 4096 a slice (a lane holds 128 of its columns as f16),
    halved while it does not divide K (8B's 14336: 2048), and one row a warp a step. 4 warps; feature
    ranges of whole steps, as many as make about four programs a multiprocessor with the slices
    (``tuning.fp8_gemv_programs`` instead of four where set). ``tuning.fp8_gemv_block_k`` overrides
    the slice width (packed: a multiple of 512)."""
    dot = tuning.fp8_gemv_dot
    if packed(rows, tuning):
        block_k = tuning.fp8_gemv_block_k or min(4096, next_power_of_2(k))
        block_k = max(512, block_k // 512 * 512)
        while not tuning.fp8_gemv_block_k and block_k > 512 and k % block_k:  # whole slices: no column masks
            block_k //= 2
        tile = 4
    else:
        block_k = tuning.fp8_gemv_block_k or (512 if rows <= 2 or dot else 256)
        block_k = max(32 if dot else 16, min(block_k, next_power_of_2(k)))
        tile = 128 if dot else 16
    splits = triton.cdiv(k, block_k)
    ranges = max(1, triton.cdiv((tuning.fp8_gemv_programs or 4) * multiprocessors, splits))
    features = max(tile, triton.cdiv(triton.cdiv(n, ranges), tile) * tile)
    return block_k, tile, features, 4


def packed(rows: int, tuning: KernelTuning) -> bool:
    """Whether a call of ``rows`` takes the packed one-row steps (``_packed_steps``)."""
    return rows == 1 and tuning.fp8_gemv_packed and not tuning.fp8_gemv_dot


def bits(rows: int, k: int, block_k: int, tuning: KernelTuning) -> bool:
    """Whether the packed steps convert by integer instructions (``_bits_steps``: whole slices only)."""
    return packed(rows, tuning) and tuning.fp8_gemv_bits and k % block_k == 0


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
             prologue: int = PLAIN, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
             eps: float = 0.0, tuning: KernelTuning = CUDA_TUNING) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [M, N] in x's dtype, x + residual for ADD_RMSNORM else None); ``takes`` must hold.

    x [M, K] (SILU: [M, 2K] = [gate | up]); weight e4m3 [N, K]; weight_scale [1] or [N, 1]. On the
    tensor cores more than one row is quantized first by fp8_quant.py's launch (the MMA's 16 rows
    would otherwise each redo the norm and amax over K in every program); one row too with
    ``tuning.fp8_gemv_quantize_first`` (then every program reads the e4m3 row instead of computing
    the prologue's norm and amax over the whole row itself: for SiLU-and-mul 2K reads and K
    exponentials a program). One row with ``tuning.fp8_gemv_mma`` (sm89+, K a multiple of 64): the
    quantization's launch, then fp8_mma_gemv.py's warp MMAs."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    n, k = weight.shape
    width = 2 * k if prologue == SILU else k
    if x.shape[1] != width:
        raise ValueError(f"fp8_gemv: x is {tuple(x.shape)}; this weight [{n}, {k}] takes rows of {width}")
    if prologue == ADD_RMSNORM and (residual is None or residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"fp8_gemv: the residual must match x {tuple(x.shape)} {x.dtype}")
    if prologue in (RMSNORM, ADD_RMSNORM) and (norm_weight is None or norm_weight.shape != (k,)):
        raise ValueError(f"fp8_gemv: the norm's weight must be [{k}]")
    if fp8_mma_gemv.takes(x, weight, weight_scale, tuning):
        return fp8_mma_gemv.fp8_mma_gemv(x, weight, weight_scale, bias, prologue, residual, norm_weight, eps, tuning)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    dot = tuning.fp8_gemv_dot
    given = (dot and rows > 1) or (rows == 1 and tuning.fp8_gemv_quantize_first)
    summed = None
    if given:
        x, s_x, summed = fp8_quant.quantize(x, prologue, residual, norm_weight, eps)
        prologue, residual = PLAIN, s_x
    elif prologue == ADD_RMSNORM:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        summed = torch.empty_like(x)
    scale = weight_scale.reshape(-1) if weight_scale.dtype == torch.float32 else weight_scale.float().reshape(-1)
    block_k, tile, features, warps = config(rows, n, k, _multiprocessors(x.device), tuning)
    splits, ranges = triton.cdiv(k, block_k), triton.cdiv(n, features)
    partial = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device)
    pdl = tuning.gemv_pdl and dependent_launch(x.device)
    fp8_gemv_kernel[(ranges, splits)](
        out, partial, counters(x.device, ranges) if splits > 1 else out,
        summed if summed is not None and not given else out, weight, scale, bias if bias is not None else out, x,
        residual if residual is not None else x, norm_weight if norm_weight is not None else x, rows, n, k, features,
        splits, x.stride(0), residual.stride(0) if residual is not None and not given else 0, out.stride(0),
        float(eps), BLOCK_M=16 if given and dot else next_power_of_2(rows),
        BLOCK_K=block_k, TILE=tile, NORM_BLOCK=min(2048, next_power_of_2(k)), PROLOGUE=prologue,
        PER_CHANNEL=weight_scale.numel() != 1, HAS_BIAS=bias is not None, DOT=dot, XQ_GIVEN=given,
        HW_CAST=not interpreting(), PDL=pdl, PREFETCH=block_k >= 128 and nvidia_at_least(x.device, (8, 0)),  # a 128-byte line each 128 columns
        PACKED=packed(rows, tuning), EVEN_K=k % block_k == 0, BITS=bits(rows, k, block_k, tuning),
        num_warps=warps, num_stages=3,
        **launch_options(pdl),
    )
    return out, summed
