"""Bidirectional attention over a flat ragged batch, with no KV cache: encoder (BERT-family) models.

An encoder sees its whole input at once, so every token attends to every token of its own
sequence (no causal mask) and to nothing of the others. Nothing is cached: an encoder computes a
sequence in one step and never decodes. The op is in the contract (``ops.REFERENCE_OPS``) so a
platform can put a variable-length kernel behind it; the reference below pads the ragged batch to
its longest sequence and masks the padding keys, which is correct on every device torch runs on.
One fused call for the whole batch beats one call per sequence, or per group of similar lengths,
on a CPU even though it computes the padding (about 3x faster than one call per sequence, on two
cores, for 85 sentences of 10-130 tokens): the per-call cost outweighs the padding's.

Layout: sequences end to end, as the engine's steps lay them out::

    query [T, H, D]   key, value [T, Hkv, D]   query_start_loc [S + 1] (device)   seq_lens [S] (host ints)
"""

from __future__ import annotations

import torch


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: list[int], scale: float) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D], query_start_loc [S + 1], seq_lens [S] -> [T, H, D]: each
    token attends to every token of its own sequence (softmax(q k^T * scale) v), in query's dtype."""
    num_seqs, longest = len(seq_lens), max(seq_lens)
    heads, kv_heads = query.shape[1], key.shape[1]
    if num_seqs == 1:  # one sequence: nothing to pad or mask
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, H, T, D]
        out = _sdpa(q, k, v, None, scale, heads != kv_heads)
        return out[0].transpose(0, 1)
    lengths = torch.tensor(seq_lens, device=query.device)
    valid = torch.arange(longest, device=query.device)[None, :] < lengths[:, None]  # [S, L]; row-major = token order
    q, k, v = (_padded(x, valid, num_seqs, longest) for x in (query, key, value))  # [S, H, L, D]
    out = _sdpa(q, k, v, valid[:, None, None, :], scale, heads != kv_heads)  # [S, H, L, D]
    return out.transpose(1, 2)[valid]  # [T, H, D]


def _padded(x: torch.Tensor, valid: torch.Tensor, num_seqs: int, longest: int) -> torch.Tensor:
    """x [T, heads, D] -> [S, heads, L, D], zeros past each sequence's end."""
    out = x.new_zeros(num_seqs, longest, *x.shape[1:])
    out[valid] = x
    return out.transpose(1, 2)


def _sdpa(q, k, v, mask, scale: float, grouped: bool) -> torch.Tensor:
    # padding queries attend to their sequence's real keys (at least one), so no row is all -inf
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=grouped)
