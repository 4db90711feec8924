"""A captured decode step replays exactly like eager after its static metadata tensors change."""

from __future__ import annotations

import random

import pytest
import torch

from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, reference_paged_attention

pytestmark = pytest.mark.cuda

NUM_SEQS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, MAX_LEN = 8, 32, 8, 128, 16, 2048


def _refill(seed, meta, q, k, v, num_blocks):
    """New lengths, block tables, slots and q/k/v copied into the same (static) tensors."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, MAX_LEN) for _ in range(NUM_SEQS)]
    lens[0] = 1
    blocks = torch.randperm(num_blocks, generator=gen)[: NUM_SEQS * (MAX_LEN // BLOCK_SIZE)]
    tables = blocks.view(NUM_SEQS, MAX_LEN // BLOCK_SIZE).to(torch.int32)
    last = torch.tensor(lens) - 1
    slots = tables[torch.arange(NUM_SEQS), last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    meta.block_tables.copy_(tables)
    meta.slot_mapping.copy_(slots)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return lens


def test_decode_graph_replay_equals_eager(gpu):
    from podium_cuda import CudaPlatform

    platform = CudaPlatform()
    backend, runner = platform.attention_backend(), platform.graph_runner()
    dtype = torch.bfloat16
    layer = AttentionLayerSpec(HEADS, KV_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5)
    num_blocks = NUM_SEQS * (MAX_LEN // BLOCK_SIZE) + 5
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, device=gpu).to(dtype)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(NUM_SEQS + 1, dtype=torch.int32, device=gpu),
        seq_lens=torch.ones(NUM_SEQS, dtype=torch.int32, device=gpu),
        block_tables=torch.zeros(NUM_SEQS, MAX_LEN // BLOCK_SIZE, dtype=torch.int32, device=gpu),
        slot_mapping=torch.zeros(NUM_SEQS, dtype=torch.int64, device=gpu),
        max_query_len=1,
        max_seq_len=MAX_LEN,  # the bound replays stay under: the split plan covers them
    )
    q = torch.empty(NUM_SEQS, HEADS, HEAD_SIZE, dtype=dtype, device=gpu)
    k = torch.empty(NUM_SEQS, KV_HEADS, HEAD_SIZE, dtype=dtype, device=gpu)
    v = torch.empty_like(k)
    assert backend.num_splits(meta, KV_HEADS) > 1  # the captured step exercises the split path
    _refill(0, meta, q, k, v, num_blocks)
    replay = runner.capture(lambda: backend.forward(layer, q, k, v, cache, meta))
    for seed in (1, 2, 3):
        lens = _refill(seed, meta, q, k, v, num_blocks)
        eager_cache = cache.clone()
        eager = backend.forward(layer, q, k, v, eager_cache, meta).clone()
        replayed = replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), f"seed {seed} lens {lens}"
        assert torch.equal(cache, eager_cache)
        ref = reference_paged_attention(q.float(), cache[0].float(), cache[1].float(), meta, scale=layer.scale)
        err = float((replayed.float() - ref).norm() / ref.norm())
        assert err < 1.5e-2, f"seed {seed}: {err:.2e}"
