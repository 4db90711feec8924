"""Ragged batches padded the way the core's model runner pads them for static-shape platforms."""

from __future__ import annotations

import torch

from podium_plugin_api import AttentionMetadata


def pow2(n: int, minimum: int) -> int:
    return 1 << (max(n, minimum) - 1).bit_length()


def padded_meta(query_lens, seq_lens, tables, block_size) -> AttentionMetadata:
    """Metadata for the real sequences, then padded like the core's runner does for XLA."""
    meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size)
    t, s, w = meta.num_tokens, meta.num_seqs, meta.block_tables.shape[1]
    t_pad, s_pad, w_pad = pow2(t, 16) - t, pow2(s, 8) - s, pow2(w, 1) - w
    qsl = meta.query_start_loc
    return AttentionMetadata(
        query_start_loc=torch.cat([qsl, qsl[-1:].repeat(s_pad)]),
        seq_lens=torch.cat([meta.seq_lens, torch.zeros(s_pad, dtype=torch.int32)]),
        block_tables=torch.nn.functional.pad(meta.block_tables, (0, w_pad, 0, s_pad)),
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((t_pad,), -1, dtype=torch.int64)]),
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
    )


def random_tables(seq_lens, block_size, gen, spare=3):
    counts = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(counts) + spare, generator=gen).tolist()
    tables, used = [], 0
    for c in counts:
        tables.append(order[used:used + c])
        used += c
    return tables, sum(counts) + spare
