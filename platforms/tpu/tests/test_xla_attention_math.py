"""The pure-XLA attention's math on plain CPU tensors, against the reference (runs without torch_xla).

Batches are padded exactly as the core's model runner pads them for static-shape platforms:
tokens to a power of two (>= 16) with slot -1, sequences to a power of two (>= 8) with
query_len 0 and seq_len 0, block-table width to a power of two. The checks: real tokens match
``reference_paged_attention`` in float64, padded tokens come out as zeros (finite), the new
tokens' K/V sit at their slots, and padded tokens wrote nothing outside the scratch block.
"""

from __future__ import annotations

import pytest
import torch
from tpu_test_batches import padded_meta, random_tables

from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, KVCacheSpec
from podium_plugin_api.reference import reference_paged_attention
from podium_tpu.xla_attention import XlaAttentionBackend, token_layout, xla_paged_attention


def run_case(query_lens, seq_lens, *, heads=8, kv_heads=2, head_size=32, block_size=4, window=None,
             soft_cap=None, token_chunk=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    backend = XlaAttentionBackend()
    tables, num_blocks = random_tables(seq_lens, block_size, gen)
    spec = KVCacheSpec(1, kv_heads, head_size, block_size, torch.float32)
    cache = torch.randn(backend.kv_cache_shape(spec, num_blocks), generator=gen)  # context: random
    meta = padded_meta(query_lens, seq_lens, tables, block_size)
    t = meta.num_tokens
    query = torch.randn(t, heads, head_size, generator=gen)
    key, value = torch.randn(t, kv_heads, head_size, generator=gen), torch.randn(t, kv_heads, head_size, generator=gen)
    before = cache.clone()
    layer = AttentionLayerSpec(heads, kv_heads, head_size, head_size**-0.5, window, soft_cap)
    backend.write_kv(cache, key, value, meta.slot_mapping)
    out = xla_paged_attention(query, *backend.split_cache(cache), meta, scale=layer.scale, sliding_window=window, soft_cap=soft_cap,
                              token_chunk=token_chunk)
    k_cache, v_cache = backend.split_cache(cache)
    ref_meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size)
    real = ref_meta.num_tokens
    expected = reference_paged_attention(query[:real].double(), k_cache.double(), v_cache.double(), ref_meta,
                                         scale=layer.scale, sliding_window=window, soft_cap=soft_cap,
                                         compute_dtype=torch.float64)
    return out, expected, real, cache, before, key, value, meta


CASES = {
    "mixed-gqa": dict(query_lens=[1, 7, 3, 1], seq_lens=[9, 7, 12, 1]),
    "decodes-mqa": dict(query_lens=[1, 1, 1], seq_lens=[5, 16, 30], kv_heads=1),
    "mha-chunked": dict(query_lens=[13, 1, 6], seq_lens=[13, 22, 17], kv_heads=8, token_chunk=8),
    "sliding-window": dict(query_lens=[1, 11, 4], seq_lens=[19, 11, 14], window=5),
    "soft-cap": dict(query_lens=[5, 1], seq_lens=[9, 6], soft_cap=2.0),
    "exact-buckets": dict(query_lens=[2] * 8, seq_lens=[3, 4, 5, 6, 7, 8, 9, 10]),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_reference_on_padded_buckets(name):
    out, expected, real, *_ = run_case(**CASES[name])
    torch.testing.assert_close(out[:real].double(), expected, rtol=1e-5, atol=1e-5)


def test_padding_is_finite_zero_and_writes_only_scratch():
    out, _, real, cache, before, key, value, meta = run_case([3, 1], [3, 8])
    assert out.shape[0] == 16 and real == 4
    assert torch.isfinite(out).all()
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    slots = meta.slot_mapping[:real]
    flat_now = cache[:, :-1].reshape(2, -1, *cache.shape[3:])
    flat_before = before[:, :-1].reshape(2, -1, *cache.shape[3:])
    untouched = torch.ones(flat_now.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_now[:, untouched], flat_before[:, untouched])  # padding wrote no real block
    assert torch.equal(flat_now[0, slots], key[:real]) and torch.equal(flat_now[1, slots], value[:real])


def test_token_layout_from_device_tensors_only():
    meta = padded_meta([2, 1, 3], [5, 9, 3], [[0, 1], [2, 3, 4], [5]], 4)
    seq_index, positions, real = token_layout(meta.query_start_loc, meta.seq_lens, meta.num_tokens)
    assert seq_index[:6].tolist() == [0, 0, 1, 2, 2, 2]
    assert positions[:6].tolist() == [3, 4, 8, 0, 1, 2]
    assert real.tolist() == [True] * 6 + [False] * 10


def test_bfloat16_cache_matches_reference_within_rounding():
    gen = torch.Generator().manual_seed(3)
    backend = XlaAttentionBackend()
    spec = KVCacheSpec(1, 2, 16, 4, torch.bfloat16)
    tables, num_blocks = random_tables([6, 10], 4, gen)
    cache = torch.randn(backend.kv_cache_shape(spec, num_blocks), generator=gen).to(torch.bfloat16)
    meta = padded_meta([6, 1], [6, 10], tables, 4)
    query = torch.randn(meta.num_tokens, 4, 16, generator=gen).to(torch.bfloat16)
    out = xla_paged_attention(query, *backend.split_cache(cache), meta, scale=0.25)
    k, v = backend.split_cache(cache)
    ref_meta = AttentionMetadata.from_lengths([6, 1], [6, 10], tables, 4)
    expected = reference_paged_attention(query[:7].double(), k.double(), v.double(), ref_meta, scale=0.25,
                                         compute_dtype=torch.float64)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:7].double(), expected, rtol=2e-2, atol=2e-2)


def test_rejects_bad_token_chunk():
    meta = padded_meta([1], [1], [[0]], 4)
    with pytest.raises(ValueError, match="token_chunk"):
        xla_paged_attention(torch.zeros(16, 2, 8), torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), meta, scale=1.0, token_chunk=0)
