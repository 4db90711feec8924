"""Triton paged attention over the flat ragged batch (prefill chunks, prefix hits and decodes alike).

One kernel serves every step. A program owns ``block_m`` query rows that share one KV head: a
tile of ``block_q = block_m // group`` consecutive new tokens of one sequence times the ``group``
query heads of that KV head (GQA/MQA), so each key/value tile read from the cache feeds the whole
group. Row r is token ``r // group``, head ``kv_head * group + r % group``::

    grid = (query tiles, num_kv_heads, num_splits)
    tiles of sequence i: query_start_loc[i] // block_q + i + (0, 1, ...)    (found by binary search)

The program walks its keys ``block_n`` at a time through the block table (``block_n`` is free of
the cache's block size), with causal / sliding-window masks, an optional soft-cap, and an online
softmax in base 2. With a tiling's ``table_blocks`` it first loads that many block-table entries
into registers and takes each tile's block ids from them (in chunks for longer contexts), so that
Triton's pipeliner multi-buffers the key / value tiles (``_attend_range``). Prefill tiles split their keys into masked edges and an unmasked middle;
decodes use one masked loop (faster on the H200, see platforms/cuda/DESIGN.md). Pure-decode steps take one tile per sequence (no search) and may split each
sequence's keys over ``num_splits`` programs (flash-decoding); a second kernel merges the splits.
A pure-decode step may also hand over its own keys and values unrotated (``NewTokens``): every
program rotates its query rows; the program of split 0 rotates the new key, stores key and value at
the slot and starts its softmax with them; then each reads the cached keys before the new one (one
kernel where the rotary + cache write pass ran before; nothing reads the slot being written).

Everything that varies per step is read from device tensors (query_start_loc, seq_lens,
block_tables), so a captured CUDA graph replays correctly after their contents change. Host
values are used only for grid sizes (tensor shapes) and to choose the split count, which is a
performance choice: any split count is correct for any sequence length.

Rows outside ``query_start_loc[0] .. query_start_loc[S]`` are not written (as in the reference).
Kernels use portable Triton so ROCm's Triton compiles them too. The one vendor intrinsic, the
PTX that converts fp8 value tiles in registers (``_fp8_tile_to_f16``), sits behind a constexpr that
is off except on NVIDIA sm89+ (Triton's cast there instead).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fused_ops import _store_cast
from .pdl import dependent_launch, gdc_launch_dependents, gdc_wait, launch_options, nvidia_at_least
from .split_k import counters, last_split, reset
from .tuning import CUDA_TUNING, AttentionTiling, KernelTuning, next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: no inf - inf = NaN


@triton.jit
def _tile_sequence(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr, SPARE: tl.constexpr):
    """Largest sequence i whose first tile index (query_start_loc[i] // BLOCK_Q + SPARE * i) is <= tile.

    Sequence i gets q_len // BLOCK_Q + SPARE tile indices (some past its tokens): SPARE 1 where its
    tiles start at its first new token, 2 where they start at a multiple of BLOCK_Q positions
    (invariant_attention.py), so one more may straddle."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + SPARE * mid
        if first <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _tanh(x):
    """tanh through exp (portable: no libdevice); exact limits at +-inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# fp8 -> fp16 of four packed cache bytes (sm89+ PTX), e4m3 and e5m2: the same values Triton's own cast gives
_FP8X4_TO_F16 = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.%s $0, lo; cvt.rn.f16x2.%s $1, hi; }"
E4M3_TO_F16 = tl.constexpr(_FP8X4_TO_F16 % ("e4m3x2", "e4m3x2"))
E5M2_TO_F16 = tl.constexpr(_FP8X4_TO_F16 % ("e5m2x2", "e5m2x2"))


@triton.jit
def _fp8_tile_to_f16(x, E5M2: tl.constexpr):
    """An fp8 cache tile as fp16, converted in the registers the tile was loaded into.

    Declared impure so Triton keeps it there: its own cast moves after the shared-memory load that
    feeds the MMA, where a [keys, head] value tile (keys not contiguous) takes one 8-bit load per
    element; converted first, the fp16 tile goes through shared memory as bf16 tiles do (ldmatrix).
    """
    return tl.inline_asm_elementwise(E5M2_TO_F16 if E5M2 else E4M3_TO_F16, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                     dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, q_pos, d, d_ok, t_begin, t_end,
    kv_lo, kv_hi, table, table_regs, table_base,
    k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap, window,
    KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TABLE_BLOCKS: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, FP8_V_REGS: tl.constexpr,
):
    """Online softmax over key tiles [t_begin, t_end); MASKED applies bounds, causal and window masks.

    FP8_V_REGS (fp8 caches): value tiles through ``_fp8_tile_to_f16`` (else Triton's cast, as keys always).
    TABLE_BLOCKS > 0: the block ids come from ``table_regs``, the block-table entries from
    ``table_base`` on, held in registers (``_attend_range``); else from ``table`` in the loop.

    acc [BLOCK_M, BLOCK_D] fp32, m_i / l_i [BLOCK_M] (base-2 running max and sum); q [BLOCK_M, BLOCK_D].
    """
    for t in range(t_begin, t_end):
        k_pos = kv_lo + t * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_ok = k_pos < kv_hi
        if TABLE_BLOCKS > 0:  # block ids from the entries in registers: no load in the address chain
            entry = tl.minimum(k_pos // KV_BLOCK_SIZE - table_base, TABLE_BLOCKS - 1)
            block = tl.gather(table_regs, entry, 0).to(tl.int64)
        elif MASKED:
            block = tl.load(table + k_pos // KV_BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        else:
            block = tl.load(table + k_pos // KV_BLOCK_SIZE).to(tl.int64)
        offset = k_pos % KV_BLOCK_SIZE
        k_ptrs = k_base + block[None, :] * stride_kb + offset[None, :] * stride_ks + d[:, None]  # [BLOCK_D, BLOCK_N]
        v_ptrs = v_base + block[:, None] * stride_vb + offset[:, None] * stride_vs + d[None, :]  # [BLOCK_N, BLOCK_D]
        if MASKED:
            k = tl.load(k_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, k.to(q.dtype), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s * (scale / soft_cap)) * LOG2E
        else:
            s = s * (scale * LOG2E)  # [BLOCK_M, BLOCK_N], base-2 logits
        if MASKED:
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8_V_REGS:
            v = _fp8_tile_to_f16(v, v_base.dtype.element_ty == tl.float8e5)
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, q_pos, d, d_ok, t_begin, t_end,
    kv_lo, kv_hi, table, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap, window,
    KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    TABLE_BLOCKS: tl.constexpr, CHUNK_TILES: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, FP8_V_REGS: tl.constexpr,
):
    """``_attend_tiles`` over [t_begin, t_end). With TABLE_BLOCKS > 0, in chunks of CHUNK_TILES tiles:
    each chunk's TABLE_BLOCKS block-table entries are loaded into registers first, so the loop's
    key / value addresses depend on no load of the loop and Triton's pipeliner can issue each tile's
    copies ``num_stages - 1`` tiles ahead; with the entries loaded in the loop it issues them one
    tile ahead whatever the stage count (one buffer a tile)."""
    if TABLE_BLOCKS > 0:
        entries = tl.arange(0, TABLE_BLOCKS)
        last_block = tl.cdiv(kv_hi, KV_BLOCK_SIZE)  # the sequence's blocks: [0, last_block)
        for i in range(0, tl.cdiv(t_end - t_begin, CHUNK_TILES)):  # (a range step trips the interpreter)
            c = t_begin + i * CHUNK_TILES
            base = (kv_lo + c * BLOCK_N) // KV_BLOCK_SIZE
            regs = tl.load(table + base + entries, mask=base + entries < last_block, other=0)
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q, q_pos, d, d_ok, c, tl.minimum(c + CHUNK_TILES, t_end),
                kv_lo, kv_hi, table, regs, base,
                k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap, window,
                KV_BLOCK_SIZE, BLOCK_N, MASKED, TABLE_BLOCKS, USE_SOFT_CAP, USE_WINDOW, IEEE, FP8_V_REGS,
            )
    else:
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, d, d_ok, t_begin, t_end,
            kv_lo, kv_hi, table, table, 0,
            k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap, window,
            KV_BLOCK_SIZE, BLOCK_N, MASKED, 0, USE_SOFT_CAP, USE_WINDOW, IEEE, FP8_V_REGS,
        )
    return acc, m_i, l_i


@triton.jit
def _rotate_row(x, partner, cos, sin, d, HALF: tl.constexpr):
    """Rotate-halves rotary on whole rows (fp32): ``x * cos - partner * sin`` in the first half,
    ``x * cos + partner * sin`` in the second, as the same FMAs as fused_ops._rotate_heads (same bits)."""
    a = x.to(tl.float32)
    b = partner.to(tl.float32)
    return tl.where(d < HALF, tl.fma(a, cos, -(b * sin)), tl.fma(a, cos, b * sin))


@triton.jit
def _attend_new_token(
    acc, m_i, l_i, q, d, d_ok, token, kv_head, cos, sin, partner, slot,
    new_k_ptr, new_v_ptr, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap,
    KV_BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
):
    """A decode token's own key and value (not yet in the cache): rotate the key, store key and
    value at ``slot`` (-1: not stored), and add them to the online softmax as one column."""
    k_src = new_k_ptr + token * stride_nkt + kv_head * stride_nkh
    k_row = tl.load(k_src + d, mask=d_ok, other=0.0)
    k_partner = tl.load(k_src + partner, mask=d_ok, other=0.0)
    # rounded to the key's dtype, then to the cache's (an fp8 cache: what write_kv would store)
    k = _store_cast(_rotate_row(k_row, k_partner, cos, sin, d, HALF).to(k_row.dtype), k_base.dtype.element_ty)
    v = tl.load(new_v_ptr + token * stride_nvt + kv_head * stride_nvh + d, mask=d_ok, other=0.0)
    v = _store_cast(v, v_base.dtype.element_ty)
    if slot >= 0:
        block = slot // KV_BLOCK_SIZE
        offset = slot % KV_BLOCK_SIZE
        tl.store(k_base + block * stride_kb + offset * stride_ks + d, k, mask=d_ok)
        tl.store(v_base + block * stride_vb + offset * stride_vs + d, v, mask=d_ok)
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1)  # [BLOCK_M]
    if USE_SOFT_CAP:
        s = soft_cap * _tanh(s * (scale / soft_cap)) * LOG2E
    else:
        s = s * (scale * LOG2E)
    m_new = tl.maximum(m_i, s)
    p = tl.exp2(s - m_new)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + p
    pv = p.to(q.dtype).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]  # p rounded as the tiles' dot rounds it
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


# Runtime integers that change from step to step are not specialized on (Triton would otherwise
# compile new variants for values equal to 1 or divisible by 16 in the middle of serving): that
# includes stride_bt, the width of an eager step's block table (the longest sequence's blocks).
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "window", "stride_bt"])
def paged_attention_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,  # out [T, H, D]; partials [T, H, NS, D] / [T, H, NS]
    q_ptr, k_cache_ptr, v_cache_ptr,  # q [T, H, D]; caches [num_blocks, block_size, Hkv, D]
    qsl_ptr, seq_lens_ptr, block_tables_ptr,  # [S + 1], [S], [S, W] int32
    new_k_ptr, new_v_ptr, pos_ptr, cos_sin_ptr, slot_ptr,  # NEW_KV: key/value [T, Hkv, D], [T], [P, D], [T]
    num_seqs, num_heads, num_splits, scale, soft_cap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_c, count_ptr,
    KV_BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    IS_DECODE: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    NEW_KV: tl.constexpr, HALF: tl.constexpr, FP16_DOT: tl.constexpr, PDL: tl.constexpr, FP8_V_REGS: tl.constexpr,
    TABLE_BLOCKS: tl.constexpr, CHUNK_TILES: tl.constexpr, MERGE: tl.constexpr = False,
):
    if PDL:  # a programmatic dependent launch (pdl.py): resident early, reads only after the wait
        gdc_launch_dependents()
        gdc_wait()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if IS_DECODE:
        seq = tile
        j = 0
    else:
        seq = _tile_sequence(qsl_ptr, num_seqs, tile, BLOCK_Q, 1)
        j = tile - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if j * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    tok = j * BLOCK_Q + rows // GROUP  # [BLOCK_M] token index within the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_ok = (tok < q_len) & (rows < BLOCK_Q * GROUP)
    q_pos = context + tok  # [BLOCK_M] absolute position of each row's token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_SIZE
    token = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if NEW_KV:  # decode, rotary and the cache write fused in: q is unrotated, the new key not yet cached
        half = d % HALF
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        pos = tl.load(pos_ptr + q_start).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_c + half, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
        sin = tl.load(cos_sin_ptr + pos * stride_c + HALF + half, mask=d_ok, other=0.0).to(tl.float32)
        q_partner = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + partner[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )
        q = _rotate_row(q, q_partner, cos[None, :], sin[None, :], d[None, :], HALF).to(q.dtype)
    if FP16_DOT:  # bf16 q over an fp8 cache: the dots (and p's rounding) in fp16, see KernelTuning
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # Keys this tile can see: [kv_lo, kv_hi), kv_lo aligned down to BLOCK_N.
    kv_hi = tl.minimum(context + (j + 1) * BLOCK_Q, seq_len)
    if NEW_KV:
        kv_hi = tl.minimum(kv_hi, seq_len - 1)  # the cached keys (seq_len - 1); split 0 adds the new one
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context + j * BLOCK_Q - window + 1, 0)
    kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
    first_tile = num_tiles * 0  # a tensor, like the split bounds below
    last_tile = num_tiles
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        first_tile = split * tiles_per_split
        last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    # Prefill: tiles [a, b) are visible to every row (no mask); the window's lower edge and the
    # causal diagonal are masked: loops over [first, a), [a, b), [b, last).
    first_pos = context + j * BLOCK_Q
    t_b = (first_pos + 1 - kv_lo) // BLOCK_N  # tiles ending at or before the first row's position
    t_a = num_tiles * 0
    if USE_WINDOW:
        t_a = tl.cdiv(tl.maximum(kv_hi - window - kv_lo, 0), BLOCK_N)  # tiles starting after kv_hi-1-window
    a = tl.minimum(tl.maximum(t_a, first_tile), last_tile)
    b = tl.minimum(tl.maximum(t_b, a), last_tile)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if NEW_KV:  # the new token's column first: its rotary inputs and unrotated query die before the loop
        # (sm90, 16/64/4/2 fp8: 128 -> 108 registers a thread, so more programs fit a multiprocessor)
        if split == 0:
            slot = tl.load(slot_ptr + q_start).to(tl.int64)
            acc, m_i, l_i = _attend_new_token(
                acc, m_i, l_i, q, d, d_ok, q_start.to(tl.int64), kv_head, cos, sin, partner, slot,
                new_k_ptr, new_v_ptr, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
                k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap,
                KV_BLOCK_SIZE, HALF, USE_SOFT_CAP,
            )
    if IS_DECODE:  # one masked loop: at one token a row the mask is cheap, and one pipelined loop
        # was faster than three on the H200 (three pipelined loops' buffers likely cost occupancy)
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, d, d_ok, first_tile, last_tile,
            kv_lo, kv_hi, table, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap, window,
            KV_BLOCK_SIZE, BLOCK_N, True, TABLE_BLOCKS, CHUNK_TILES, USE_SOFT_CAP, USE_WINDOW, IEEE, FP8_V_REGS,
        )
    else:
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, d, d_ok, first_tile, a,
            kv_lo, kv_hi, table, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap, window,
            KV_BLOCK_SIZE, BLOCK_N, True, TABLE_BLOCKS, CHUNK_TILES, USE_SOFT_CAP, USE_WINDOW, IEEE, FP8_V_REGS,
        )
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, d, d_ok, a, b,
            kv_lo, kv_hi, table, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap, window,
            KV_BLOCK_SIZE, BLOCK_N, False, TABLE_BLOCKS, CHUNK_TILES, USE_SOFT_CAP, USE_WINDOW, IEEE, FP8_V_REGS,
        )
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, d, d_ok, b, last_tile,
            kv_lo, kv_hi, table, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap, window,
            KV_BLOCK_SIZE, BLOCK_N, True, TABLE_BLOCKS, CHUNK_TILES, USE_SOFT_CAP, USE_WINDOW, IEEE, FP8_V_REGS,
        )

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (token * num_heads + head) * num_splits + split  # [BLOCK_M] row of [T * H * NS]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_SIZE + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        if MERGE:  # the (sequence, kv head)'s last split to finish merges them all: no merge launch
            group_id = seq * (num_heads // GROUP) + kv_head
            if last_split(count_ptr, group_id, num_splits):
                _merge_rows(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, token, head, row_ok, d, d_ok, num_heads,
                            num_splits, stride_ot, stride_oh, HEAD_SIZE)
                reset(count_ptr, group_id, num_splits)


@triton.jit
def _merge_rows(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, token, head, row_ok, d, d_ok, num_heads, num_splits,
                stride_ot, stride_oh, HEAD_SIZE: tl.constexpr):
    """merge_splits_kernel's sums for a program's rows (token, head), the splits in order: read past L1
    (.cg), where the other programs' partials are visible once last_split has counted them in."""
    base = (token * num_heads + head) * num_splits  # [BLOCK_M]
    top = tl.full(base.shape, NEG_BIG, tl.float32)
    for s in range(0, num_splits):
        top = tl.maximum(top, tl.load(part_m_ptr + base + s, mask=row_ok, other=NEG_BIG, cache_modifier=".cg"))
    total = tl.zeros(base.shape, tl.float32)
    acc = tl.zeros([base.shape[0], d.shape[0]], tl.float32)
    for s in range(0, num_splits):
        weight = tl.exp2(tl.load(part_m_ptr + base + s, mask=row_ok, other=NEG_BIG, cache_modifier=".cg") - top)
        total += weight * tl.load(part_l_ptr + base + s, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc += weight[:, None] * tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_SIZE + d[None, :],
                                         mask=row_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, qsl_ptr,
    num_heads, stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s for a decode token t (grid (S, H))."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.load(qsl_ptr + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1)
    part = (token * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)  # [NS]
    m = tl.load(part_m_ptr + part)
    weight = tl.exp2(m - tl.max(m, 0))  # [NS]
    total = tl.sum(weight * tl.load(part_l_ptr + part), 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_SIZE
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_SIZE + d[None, :], mask=d_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _new_token_pointers(new: NewTokens) -> tuple[torch.Tensor, ...]:
    """The kernel's argument order: key, value, positions, cos_sin_cache, slot_mapping."""
    return new.key, new.value, new.positions, new.cos_sin_cache, new.slot_mapping


def _new_token_strides(new: NewTokens) -> tuple[int, int, int, int, int]:
    return new.key.stride(0), new.key.stride(1), new.value.stride(0), new.value.stride(1), new.cos_sin_cache.stride(0)


def _fp8_convert(tuning: KernelTuning, key_cache: torch.Tensor) -> bool:
    """``tuning.fp8_values_in_registers`` for an e4m3 / e5m2 cache on an NVIDIA GPU of compute
    capability 8.9+ (the PTX converts), else False (Triton's casts: other caches, HIP, the interpreter)."""
    if key_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not nvidia_at_least(key_cache.device, (8, 9)):
        return False
    return tuning.fp8_values_in_registers


def _table_chunk(table_blocks: int, block_n: int, kv_block_size: int) -> tuple[int, int]:
    """(TABLE_BLOCKS, CHUNK_TILES): block-table entries a program holds in registers and the key tiles
    they cover (a tile may start inside a block unless block_n is a multiple of the block size);
    (0, 1) when off or when one tile's blocks would not fit."""
    if table_blocks <= 0:
        return 0, 1
    aligned = block_n % kv_block_size == 0  # tiles start at multiples of block_n, so on block boundaries

    def blocks(tiles: int) -> int:  # most blocks `tiles` consecutive tiles touch
        keys = tiles * block_n
        return keys // kv_block_size if aligned else (keys + kv_block_size - 2) // kv_block_size + 1

    tiles = table_blocks * kv_block_size // block_n
    while tiles >= 1 and blocks(tiles) > table_blocks:
        tiles -= 1
    return (table_blocks, tiles) if tiles >= 1 else (0, 1)


def _launch_shape(tiling: AttentionTiling, group: int, block_d: int) -> tuple[int, int, int]:
    """(block_m, block_q, num_stages) for a GQA group: rows per program cover at least one token's
    group; heads over 128 halve the rows and cap the pipeline depth (registers, shared memory)."""
    block_m, num_stages = tiling.block_m, tiling.num_stages
    if block_d > 128:
        block_m, num_stages = max(block_m // 2, 16), min(num_stages, 2)
    block_m = max(block_m, next_power_of_2(group))
    return block_m, block_m // group, num_stages


class NewTokens(NamedTuple):
    """A decode step's own keys and values, given to ``paged_attention`` instead of written first:
    the kernel rotates the queries and keys (rotate-halves rotary at ``positions`` from
    ``cos_sin_cache`` [max_pos, D]: cos then sin), stores key and value at ``slot_mapping`` (-1:
    not stored) and attends to them (``forward_rotary``'s write + attention in one kernel)."""

    positions: torch.Tensor  # [T] int
    key: torch.Tensor  # [T, Hkv, D], unrotated (last dim contiguous)
    value: torch.Tensor  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor  # [max_pos, D]
    slot_mapping: torch.Tensor  # [T] int64


def _check_new_tokens(new: NewTokens, query: torch.Tensor, key_cache: torch.Tensor) -> NewTokens:
    num_tokens, _, head_size = query.shape
    shape = (num_tokens, key_cache.shape[2], head_size)
    if tuple(new.key.shape) != shape or tuple(new.value.shape) != shape:
        raise ValueError(f"paged_attention: new key {tuple(new.key.shape)} / value {tuple(new.value.shape)} "
                         f"must be {list(shape)}")
    if new.positions.shape != (num_tokens,) or new.slot_mapping.shape != (num_tokens,):
        raise ValueError(f"paged_attention: positions {tuple(new.positions.shape)} and slot_mapping "
                         f"{tuple(new.slot_mapping.shape)} must be [{num_tokens}]")
    if head_size % 2 or new.cos_sin_cache.shape[-1] != head_size:
        raise ValueError(f"paged_attention: cos_sin_cache {tuple(new.cos_sin_cache.shape)} needs an even "
                         f"head_size {head_size}")
    key = new.key if new.key.stride(2) == 1 else new.key.contiguous()
    value = new.value if new.value.stride(2) == 1 else new.value.contiguous()
    cache = new.cos_sin_cache if new.cos_sin_cache.stride(-1) == 1 else new.cos_sin_cache.contiguous()
    return NewTokens(new.positions, key, value, cache, new.slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    new_tokens: NewTokens | None = None,
    tuning: KernelTuning = CUDA_TUNING,
) -> torch.Tensor:
    """Attention of a flat ragged batch over a paged cache that already holds the new tokens.

    query [T, H, D] (last dim contiguous); key/value_cache [num_blocks, block_size, Hkv, D];
    query_start_loc int32 [S + 1], seq_lens int32 [S], block_tables int32 [S, W].
    ``max_query_len == 1`` selects the decode launch (one program per sequence and KV head), where
    ``num_splits`` (a power of two) splits the keys. Returns ``out`` [T, H, D] in query's dtype.
    With ``new_tokens`` (decode only) the cache does not hold the step's tokens yet and ``query``
    is unrotated: see ``NewTokens``.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("paged_attention needs query and caches contiguous in their last (head_size) dim")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    is_decode = max_query_len == 1
    if new_tokens is not None:
        if not is_decode:
            raise ValueError("paged_attention: new_tokens needs a pure-decode step (max_query_len 1)")
        new_tokens = _check_new_tokens(new_tokens, query, key_cache)
    tiling = tuning.decode if is_decode else tuning.prefill
    fp8_convert = _fp8_convert(tuning, key_cache)
    fp8_tiling = tuning.fp8_prefill
    if is_decode:
        fp8_tiling = tuning.fp8_split_decode if num_splits > 1 and tuning.fp8_split_decode else tuning.fp8_decode
    if fp8_convert and fp8_tiling is not None:
        tiling = fp8_tiling
    block_d = max(next_power_of_2(head_size), 16)  # tl.dot needs K >= 16
    block_m, block_q, num_stages = _launch_shape(tiling, group, block_d)
    num_splits = num_splits if is_decode else 1
    table_blocks, chunk_tiles = _table_chunk(tiling.table_blocks, tiling.block_n, key_cache.shape[1])
    grid = (num_seqs if is_decode else num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    pdl = tuning.attention_pdl and dependent_launch(query.device)
    merge = num_splits > 1 and tuning.attention_merge_in_kernel
    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_size), dtype=torch.float32, device=query.device)
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    paged_attention_kernel[grid](
        out, part_acc, part_m, part_l,
        query, key_cache, value_cache,
        query_start_loc, seq_lens, block_tables,
        *(_new_token_pointers(new_tokens) if new_tokens else (query, query, seq_lens, query, seq_lens)),
        num_seqs, num_heads, num_splits, float(scale), float(soft_cap or 1.0), int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        *(_new_token_strides(new_tokens) if new_tokens else (0, 0, 0, 0, 0)),
        counters(query.device, num_seqs * num_kv_heads) if merge else out,
        KV_BLOCK_SIZE=key_cache.shape[1], GROUP=group, HEAD_SIZE=head_size, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=tiling.block_n, SPLIT=num_splits > 1,
        IS_DECODE=is_decode, USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=sliding_window is not None,
        IEEE=query.dtype == torch.float32, NEW_KV=new_tokens is not None, HALF=max(head_size // 2, 1),
        FP16_DOT=tuning.fp8_dot_in_fp16 and query.dtype == torch.bfloat16 and key_cache.element_size() == 1,
        PDL=pdl, FP8_V_REGS=fp8_convert, TABLE_BLOCKS=table_blocks, CHUNK_TILES=chunk_tiles, MERGE=merge, num_warps=tiling.num_warps, num_stages=num_stages,
        **launch_options(pdl),
    )
    if num_splits > 1 and not merge:
        merge_splits_kernel[(num_seqs, num_heads)](
            out, part_acc, part_m, part_l, query_start_loc,
            num_heads, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, BLOCK_D=block_d, NUM_SPLITS=num_splits, PDL=pdl,
            num_warps=tuning.reduce_num_warps, **launch_options(pdl),
        )
    return out
