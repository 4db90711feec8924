"""The contract's reference paged attention against a naive float64 per-token implementation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from podium_plugin_api import AttentionBackend, AttentionMetadata, KVCacheSpec, reference_paged_attention


def naive_attention(q_tok, keys, values, pos, scale, window, cap):
    """One query token at position ``pos`` over keys/values [L, Hkv, D] (float64, loops)."""
    num_heads, group = q_tok.shape[0], q_tok.shape[0] // keys.shape[1]
    out = torch.zeros_like(q_tok)
    for h in range(num_heads):
        kv_h = h // group
        scores = []
        for j in range(pos + 1):
            if window is not None and j <= pos - window:
                scores.append(-math.inf)
                continue
            s = float(q_tok[h] @ keys[j, kv_h]) * scale
            scores.append(cap * math.tanh(s / cap) if cap else s)
        m = max(scores)
        w = [math.exp(s - m) for s in scores]
        total = sum(w)
        for j, wj in enumerate(w):
            out[h] += (wj / total) * values[j, kv_h]
    return out


def random_case(rng: random.Random, block_size: int, num_heads: int, num_kv_heads: int, head_size: int = 8):
    num_seqs = rng.randint(1, 4)
    seq_lens = [rng.randint(1, 5 * block_size) for _ in range(num_seqs)]
    query_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]  # decode, full prefill, chunk
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks scattered, not contiguous
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size)
    spec = KVCacheSpec(1, num_kv_heads, head_size, block_size, torch.float64)
    backend = AttentionBackend()
    cache = torch.zeros(backend.kv_cache_shape(spec, num_blocks), dtype=torch.float64)
    # full context K/V per sequence; the earlier (cached) part is written first, as a previous step would
    contexts = [(torch.randn(s, num_kv_heads, head_size, dtype=torch.float64),
                 torch.randn(s, num_kv_heads, head_size, dtype=torch.float64)) for s in seq_lens]
    for (k, v), table, s in zip(contexts, tables, seq_lens):
        old = AttentionMetadata.from_lengths([s], [s], [table], block_size)
        backend.write_kv(cache, k, v, old.slot_mapping)
    query = torch.randn(sum(query_lens), num_heads, head_size, dtype=torch.float64)
    return meta, cache, contexts, query, backend


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window,cap", [(None, None), (3, None), (None, 5.0), (7, 2.0)])
def test_reference_matches_naive_float64(block_size, heads, window, cap):
    rng = random.Random(hash((block_size, heads, window, cap)) & 0xFFFF)
    torch.manual_seed(rng.randint(0, 1000))
    for _ in range(2):
        meta, cache, contexts, query, backend = random_case(rng, block_size, *heads)
        scale = 0.3
        key_cache, value_cache = backend.split_cache(cache)
        got = reference_paged_attention(query, key_cache, value_cache, meta, scale=scale, sliding_window=window,
                                        soft_cap=cap, compute_dtype=torch.float64)
        starts = meta.query_start_loc.tolist()
        for i, (k, v) in enumerate(contexts):
            s, q_len = meta.seq_lens_host[i], meta.query_lens_host[i]
            for t in range(q_len):
                want = naive_attention(query[starts[i] + t], k, v, s - q_len + t, scale, window, cap)
                torch.testing.assert_close(got[starts[i] + t], want, rtol=1e-10, atol=1e-10)


def test_write_then_read_roundtrip_and_padding_slots_skipped():
    backend = AttentionBackend()
    spec = KVCacheSpec(1, 2, 4, 4, torch.float32)
    cache = torch.zeros(backend.kv_cache_shape(spec, 3))
    key, value = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    slots = torch.tensor([5, -1, 11])
    backend.write_kv(cache, key, value, slots)
    k, v = backend.read_kv(cache, torch.tensor([5, 11]))
    torch.testing.assert_close(k, key[[0, 2]])
    torch.testing.assert_close(v, value[[0, 2]])
    assert int((cache != 0).sum()) == 2 * 2 * 2 * 4  # only two slots written, keys and values


def test_metadata_rejects_inconsistent_lengths():
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.from_lengths([5], [4], [[0]], 4)
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.from_lengths([1], [9], [[0, 1]], 4)
