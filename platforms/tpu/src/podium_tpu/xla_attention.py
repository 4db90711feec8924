"""Paged attention in plain torch ops that trace into one static XLA graph per bucketed shape.

Nothing here reads a host value that changes between steps (``max_query_len``, ``max_seq_len``,
the host length lists): every shape comes from the bucketed tensors the model runner pads to,
and every length from device tensor contents. So a step compiles once per bucket and then only
replays. The same code runs on plain CPU tensors, which is how the normal test suite checks it.

Layout: the default one plus a scratch block at the end, reserved for padded tokens::

    kv_cache [2, num_blocks + 1, block_size, num_kv_heads, head_size]
              k/v  ^ block ids 0..num_blocks-1 belong to the core; block num_blocks is scratch

A padded token (slot -1) is written into the scratch block, so the cache write is one static
``index_copy_`` over all T tokens instead of a data-dependent filter.

Attention, per token ``t`` of sequence ``s(t)`` at position ``p(t)``::

    keys(t)  = the blocks of block_tables[s(t)] laid end to end       [W * block_size, Hkv, D]
    visible  = key position k <= p(t)  (and k > p(t) - window)
    padding tokens see every key (finite softmax) and output zeros

The context is gathered per token rather than per sequence: memory grows with T x context, not
with T x S x context as one [S, W * block_size] context per sequence attended by every token
would, which keeps large decode batches cheap; tokens go in slabs of ``TOKEN_CHUNK`` to bound it.
"""

from __future__ import annotations

import torch

from podium_plugin_api import AttentionBackend, AttentionLayerSpec, AttentionMetadata, KVCacheSpec

from .graph import StepBoundary

TOKEN_CHUNK = 256  # tokens attended per gathered slab; bounds the [chunk, W*bs, Hkv, D] gather


def scratch_slots(slot_mapping: torch.Tensor, scratch: int) -> torch.Tensor:
    """slot_mapping [T] with every -1 (padding: write nowhere) sent to the scratch slot, as long."""
    return torch.where(slot_mapping >= 0, slot_mapping, torch.full_like(slot_mapping, scratch)).long()


def token_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int):
    """Per flat token: (sequence index [T] long, position [T] long, is-real [T] bool).

    Works from device tensors only. Padded tokens (past ``query_start_loc[-1]``) get the last
    sequence's index and are marked not real; zero-length sequences own no tokens.
    """
    ends = query_start_loc[1:].long()  # [S]
    t = torch.arange(num_tokens, device=query_start_loc.device)  # [T]
    seq_index = (ends[None, :] <= t[:, None]).sum(dim=1)  # [T] in [0, S]
    real = t < query_start_loc[-1].long()  # [T]
    seq_index = seq_index.clamp(max=ends.shape[0] - 1)
    positions = seq_lens.long()[seq_index] - ends[seq_index] + t  # [T]
    return seq_index, positions, real


def visibility_mask(positions: torch.Tensor, real: torch.Tensor, context: int, sliding_window: int | None):
    """[T, context] bool: which key positions each token attends to (padding: all, to stay finite)."""
    k = torch.arange(context, device=positions.device)[None, :]  # [1, L]
    p = positions[:, None]  # [T, 1]
    mask = k <= p
    if sliding_window is not None:
        mask = mask & (k > p - sliding_window)
    return mask | ~real[:, None]


def gather_context(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Each token's sequence context [t, W * block_size, Hkv, D] from cache [N, bs, Hkv, D], tables [t, W]."""
    _, block_size, hkv, d = cache.shape
    t, w = tables.shape
    return cache[tables.long()].reshape(t, w * block_size, hkv, d)  # [t, W, bs, Hkv, D] -> flat context


def attend_chunk(query, keys, values, mask, scale: float, soft_cap: float | None, compute_dtype):
    """query [t, H, D], keys/values [t, L, Hkv, D], mask [t, L] -> [t, H, D] in compute_dtype."""
    t, h, d = query.shape
    hkv = keys.shape[2]
    q = query.to(compute_dtype).reshape(t, hkv, h // hkv, d)  # [t, Hkv, G, D]
    scores = torch.einsum("tkgd,tlkd->tkgl", q, keys.to(compute_dtype)) * scale  # [t, Hkv, G, L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("tkgl,tlkd->tkgd", probs, values.to(compute_dtype))  # [t, Hkv, G, D]
    return out.reshape(t, h, d)


def xla_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    token_chunk: int = TOKEN_CHUNK,
) -> torch.Tensor:
    """query [T, H, D] over key/value caches [N, block_size, Hkv, D] (any strides) -> [T, H, D], query's dtype."""
    if token_chunk < 1:
        raise ValueError(f"token_chunk must be >= 1, got {token_chunk}")
    num_tokens = query.shape[0]
    seq_index, positions, real = token_layout(meta.query_start_loc, meta.seq_lens, num_tokens)
    context = meta.block_tables.shape[1] * key_cache.shape[1]  # W * block_size
    pieces = []
    for lo in range(0, num_tokens, token_chunk):  # static: num_tokens is a bucketed shape
        hi = min(lo + token_chunk, num_tokens)
        tables = meta.block_tables[seq_index[lo:hi]]  # [t, W]
        keys, values = gather_context(key_cache, tables), gather_context(value_cache, tables)
        mask = visibility_mask(positions[lo:hi], real[lo:hi], context, sliding_window)
        pieces.append(attend_chunk(query[lo:hi], keys, values, mask, scale, soft_cap, compute_dtype))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [T, H, D]
    return torch.where(real[:, None, None], out, torch.zeros_like(out)).to(query.dtype)


class XlaAttentionBackend(StepBoundary, AttentionBackend):
    """Pure-XLA paged attention: static shapes, device-side lengths, a scratch block for padding."""

    name = "xla-paged"

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_size)

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store key/value [T, Hkv, D] at their slots; slot -1 lands in the scratch block."""
        _, blocks, block_size, hkv, d = kv_cache.shape
        flat = kv_cache.view(2, blocks * block_size, hkv, d)
        slots = scratch_slots(slot_mapping, (blocks - 1) * block_size)  # [T]
        flat.index_copy_(1, slots, torch.stack((key, value)).to(flat.dtype))

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key/value [T, Hkv, D] stored at ``slot_mapping`` (real slots only)."""
        _, blocks, block_size, hkv, d = kv_cache.shape
        flat = kv_cache.reshape(2, blocks * block_size, hkv, d)
        return flat[0, slot_mapping.long()], flat[1, slot_mapping.long()]

    def attend(
        self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        key_cache, value_cache = self.split_cache(kv_cache)
        return xla_paged_attention(
            query, key_cache, value_cache, meta, scale=layer.scale, sliding_window=layer.sliding_window, soft_cap=layer.soft_cap
        )
