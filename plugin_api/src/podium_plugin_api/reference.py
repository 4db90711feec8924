"""Pure-torch reference paged attention: the definition every backend is tested against.

Slow and simple on purpose (one sequence at a time, float32 math). Cache layout is the default
one: ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_size]``.
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def indexable(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` as integers of its width where it is an 8-bit float: torch before 2.10 or so has no
    CPU indexing kernels for fp8 (``index_cpu``), and bytes index the same. View results back with
    ``.view(cache.dtype)``."""
    if cache.is_floating_point() and cache.element_size() == 1:
        return cache.view(torch.uint8)
    return cache


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence: [length, num_kv_heads, head_size]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = block_table[:num_blocks].long()
    rows = indexable(cache)[blocks].view(cache.dtype)
    return rows.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def attention_mask(query_len: int, seq_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """[query_len, seq_len] bool: True where the query (the last ``query_len`` positions) may look."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """Dense attention for one sequence. q [Q, H, D], k/v [K, Hkv, D], mask [Q, K] -> [Q, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of a flat ragged batch over a paged cache (which already holds the new tokens).

    query [T, H, D] -> output [T, H, D] in query's dtype.
    """
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        k = gather_context(key_cache, meta.block_tables[i], seq_len).to(compute_dtype)
        v = gather_context(value_cache, meta.block_tables[i], seq_len).to(compute_dtype)
        mask = attention_mask(hi - lo, seq_len, sliding_window, query.device)
        o = attend_one(query[lo:hi].to(compute_dtype), k, v, mask, scale, soft_cap)
        out[lo:hi] = o.to(query.dtype)
    return out
