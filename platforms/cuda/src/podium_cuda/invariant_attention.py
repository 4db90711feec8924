"""Batch-invariant paged attention: a query token's output has the same bits whether it is computed
in a prefill chunk (any chunk size, after a cached prefix or not) or as a decode, alone or in any batch.

The default kernel (paged_attention.py) is tuned per step kind, and that changes the order in which a
query's scores are summed: prefill tiles walk 32-key tiles in three loops (masked edges, an
unmasked middle whose arithmetic the compiler may contract differently), decodes 64-key tiles in
one, a decode's own key is scored first (``NewTokens``) and small decode batches split the keys
over a batch-dependent number of programs. Here one kernel serves every launch, with one tiling
(``KernelTuning.invariant_attention``) and one code path::

    grid = (num_tokens // BLOCK_Q + 2 * num_seqs, num_kv_heads)
    a program: BLOCK_Q consecutive positions [t * BLOCK_Q, (t + 1) * BLOCK_Q) of one sequence
               (aligned to absolute positions, not to the chunk) x the GROUP query heads of a KV head
    row r:     position t * BLOCK_Q + r // GROUP, head kv_head * GROUP + r % GROUP

Why a token's row sees the same arithmetic in every launch:

- its place in the program depends only on its position (``position % BLOCK_Q``), so even a
  matrix unit (or the interpreter's BLAS) that rounds by row place treats it alike; the other rows
  (other tokens, or nothing) only add rows to the products, which no row's result reads;
- its keys are walked in ``BLOCK_N`` tiles at multiples of ``BLOCK_N`` positions, in order, by one
  masked loop and one online softmax; a tile that holds none of its visible keys (a later row's
  causal keys, a window edge an earlier row needs) leaves its running max, sum and accumulator
  exactly as they were (scores -inf: p = 0, the rescale exp2(0) = 1); keys past its position
  inside a tile are masked to p = 0, so whatever values they hold add exact zeros;
- no split of the keys over programs at any length, no new-token column: a decode's key and value
  reach the cache first (``rotary_write_kv``) and are read back like every other key.

The cost against the default kernel: prompt tokens are attended in 4-token programs (GQA group 4)
over decode-sized tiles rather than 32-token ones, so a prefill reads each key tile more often;
decodes cost what the default decode launch does at batch sizes that need no split.
Values that vary per step are read from device tensors, so CUDA graphs replay it as they replay
the default kernel; padded graph rows (length 1, slot -1) are rows like any other.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from podium_plugin_api import AttentionLayerSpec, AttentionMetadata

from .attention import TritonAttentionBackend
from .paged_attention import NEG_BIG, _attend_range, _fp8_convert, _launch_shape, _table_chunk, _tile_sequence
from .tuning import CUDA_TUNING, AttentionTiling, KernelTuning, next_power_of_2


@triton.jit(do_not_specialize=["num_seqs", "window", "stride_bt"])
def invariant_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,  # out / q [T, H, D]; caches [num_blocks, block_size, Hkv, D]
    qsl_ptr, seq_lens_ptr, block_tables_ptr,  # [S + 1], [S], [S, W] int32
    num_seqs, scale, soft_cap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    KV_BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, FP16_DOT: tl.constexpr,
    FP8_V_REGS: tl.constexpr, TABLE_BLOCKS: tl.constexpr, CHUNK_TILES: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _tile_sequence(qsl_ptr, num_seqs, tile, BLOCK_Q, 2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # position of the sequence's first new token
    tile_start = (context // BLOCK_Q + tile - (q_start // BLOCK_Q + 2 * seq)) * BLOCK_Q  # position of row 0
    if tile_start >= seq_len:  # one of the sequence's spare tile indices
        return

    rows = tl.arange(0, BLOCK_M)
    q_pos = tile_start + rows // GROUP  # [BLOCK_M] absolute position of each row's token
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_ok = (q_pos >= context) & (q_pos < seq_len) & (rows < BLOCK_Q * GROUP)
    token = tl.where(row_ok, q_start + q_pos - context, 0).to(tl.int64)  # [BLOCK_M] row of q / out
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_SIZE
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if FP16_DOT:  # bf16 q over an fp8 cache: the dots in fp16 (KernelTuning.fp8_dot_in_fp16)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # keys [kv_lo, kv_hi): every row's visible keys, kv_lo a multiple of BLOCK_N
    kv_hi = tl.minimum(tile_start + BLOCK_Q, seq_len)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(tl.maximum(tile_start, context) - window + 1, 0)
    kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, q_pos, d, d_ok, num_tiles * 0, num_tiles,
        kv_lo, kv_hi, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        stride_kb, stride_ks, stride_vb, stride_vs, scale, soft_cap, window,
        KV_BLOCK_SIZE, BLOCK_N, True, TABLE_BLOCKS, CHUNK_TILES, USE_SOFT_CAP, USE_WINDOW, IEEE, FP8_V_REGS,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def invariant_tiling(tuning: KernelTuning, key_cache: torch.Tensor) -> tuple[AttentionTiling, bool]:
    """(the mode's tiling, fp8 values converted in registers) for this cache: fixed per engine."""
    fp8_convert = _fp8_convert(tuning, key_cache)
    if fp8_convert and tuning.invariant_fp8_attention is not None:
        return tuning.invariant_fp8_attention, True
    return tuning.invariant_attention, fp8_convert


def invariant_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    tuning: KernelTuning = CUDA_TUNING,
) -> torch.Tensor:
    """Attention of a flat ragged batch over a paged cache that already holds the new tokens, each
    token's result independent of the batch (module docstring). Shapes as ``paged_attention``:
    query [T, H, D] (last dim contiguous); key/value_cache [num_blocks, block_size, Hkv, D];
    query_start_loc int32 [S + 1], seq_lens int32 [S], block_tables int32 [S, W] -> out [T, H, D]."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, num_seqs = key_cache.shape[2], seq_lens.shape[0]
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("invariant_attention needs query and caches contiguous in their last (head_size) dim")
    if num_heads % num_kv_heads:
        raise ValueError(f"invariant_attention: {num_heads} query heads do not group over {num_kv_heads} KV heads")
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    tiling, fp8_convert = invariant_tiling(tuning, key_cache)
    block_d = max(next_power_of_2(head_size), 16)  # tl.dot needs K >= 16
    block_m, block_q, num_stages = _launch_shape(tiling, group, block_d)
    table_blocks, chunk_tiles = _table_chunk(tiling.table_blocks, tiling.block_n, key_cache.shape[1])
    grid = (num_tokens // block_q + 2 * num_seqs, num_kv_heads)
    invariant_attention_kernel[grid](
        out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
        num_seqs, float(scale), float(soft_cap or 1.0), int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        KV_BLOCK_SIZE=key_cache.shape[1], GROUP=group, HEAD_SIZE=head_size, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=tiling.block_n,
        USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=sliding_window is not None,
        IEEE=query.dtype == torch.float32,
        FP16_DOT=tuning.fp8_dot_in_fp16 and query.dtype == torch.bfloat16 and key_cache.element_size() == 1,
        FP8_V_REGS=fp8_convert, TABLE_BLOCKS=table_blocks, CHUNK_TILES=chunk_tiles,
        num_warps=tiling.num_warps, num_stages=num_stages,
    )
    return out


class InvariantAttentionBackend(TritonAttentionBackend):
    """The CUDA platform's attention in the batch-invariant mode: the Triton KV write (rotary fused
    in, as for prompts) and ``invariant_attention`` for every step; no pure-torch fallback, whose
    matmuls are not batch-invariant, so an unsupported layer is refused."""

    name = "triton-invariant"

    def __init__(self, tuning: KernelTuning = CUDA_TUNING, fp8_flavour: str | None = None) -> None:
        # a decode's key goes through the cache like a prompt's (no NewTokens), one launch a step
        super().__init__(replace(tuning, decode_rotary_in_attention=False, mixed_decode_min=0), fp8_flavour)

    def attend(self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        if not self.supports(layer, query):
            raise NotImplementedError(
                f"the cuda platform's batch-invariant attention takes head sizes up to {self.tuning.max_head_size} "
                f"and float16/bfloat16/float32 queries; this layer has head size {layer.head_size} and "
                f"{str(query.dtype).removeprefix('torch.')} queries (run without --batch-invariant)")
        return super().attend(layer, query, kv_cache, meta)

    def _paged_attention(self, layer, query, key_cache, value_cache, meta, new_tokens=None) -> torch.Tensor:
        return invariant_attention(query, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.block_tables, scale=layer.scale, sliding_window=layer.sliding_window,
                                   soft_cap=layer.soft_cap, tuning=self.tuning)
