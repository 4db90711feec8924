"""Speculative verify graphs pad every row to q = k + 1 query tokens (core ``runner/verify_graphs``):
row i's real tokens first, its length start + q. The paged attention must give the real rows
exactly what the ragged, unpadded step gives (each query sees its own causal prefix only)."""

from __future__ import annotations

import pytest
import torch

from podium_cuda.paged_attention import paged_attention

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("block_size", [4, 16])
def test_rows_padded_to_k_plus_one_tokens_equal_the_ragged_step(kernel_device, block_size):
    torch.manual_seed(0)
    dev, q, heads, kv_heads, dim = kernel_device, 5, 4, 2, 32
    starts, lens = [7, 30, 2, 0], [1, 5, 3, 2]  # the last token + d drafts of each row
    blocks = 64
    key_cache = torch.randn(blocks, block_size, kv_heads, dim, device=dev)
    value_cache = torch.randn(blocks, block_size, kv_heads, dim, device=dev)
    width = -(-(max(starts) + q) // block_size)
    tables = torch.randperm(blocks)[:len(starts) * width].view(len(starts), width).int().to(dev)
    queries = [torch.randn(n, heads, dim, device=dev) for n in lens]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    ragged = paged_attention(torch.cat(queries), key_cache, value_cache, cu,
                             torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32, device=dev),
                             tables, scale=dim ** -0.5, max_query_len=max(lens))
    padded_q = torch.zeros(len(starts) * q, heads, dim, device=dev)
    for i, x in enumerate(queries):
        padded_q[i * q:i * q + len(x)] = x
    padded = paged_attention(padded_q, key_cache, value_cache,
                             torch.arange(len(starts) + 1, dtype=torch.int32, device=dev) * q,
                             torch.tensor([s + q for s in starts], dtype=torch.int32, device=dev),
                             tables, scale=dim ** -0.5, max_query_len=q)
    real = torch.cat([padded[i * q:i * q + n] for i, n in enumerate(lens)])
    torch.testing.assert_close(real, ragged, rtol=1e-5, atol=1e-5)
