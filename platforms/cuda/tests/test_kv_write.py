"""Triton KV write by slot mapping: round trip through read_kv, skipped slots, untouched cache."""

from __future__ import annotations

import random

import pytest
import torch

from podium_plugin_api import AttentionBackend, KVCacheSpec

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_size,block_size", [(8, 128, 16), (2, 64, 16), (3, 96, 5), (1, 256, 32)])
def test_write_matches_reference_write_and_reads_back(
    dtype, num_kv_heads, head_size, block_size, kernel_device, check_dtype
):
    from podium_cuda.attention import TritonAttentionBackend

    check_dtype(dtype)
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(1, num_kv_heads, head_size, block_size, dtype)
    backend, reference = TritonAttentionBackend(), AttentionBackend()
    num_blocks, num_tokens = 12, 40
    start = torch.randn(backend.kv_cache_shape(spec, num_blocks), generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:7]] = -1  # padding tokens: not written
    # key/value as views of a fused qkv projection (token stride > Hkv * D), fp32 source for dtype casts
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_size, generator=gen)
    key = qkv[:, num_kv_heads * head_size: 2 * num_kv_heads * head_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, 2 * num_kv_heads * head_size:].view(num_tokens, num_kv_heads, head_size)
    expected = start.clone()
    reference.write_kv(expected, key, value, slots)

    cache = start.clone().to(kernel_device)
    backend.write_kv(cache, key.to(kernel_device), value.to(kernel_device), slots.to(kernel_device))
    assert torch.equal(cache.cpu(), expected), f"seed {seed}"
    kept = slots >= 0
    k_back, v_back = backend.read_kv(cache, slots[kept].to(kernel_device))
    assert torch.equal(k_back.cpu(), key[kept].to(dtype)) and torch.equal(v_back.cpu(), value[kept].to(dtype))


def test_write_rejects_mismatched_shapes(kernel_device):
    from podium_cuda.kv_write import write_kv

    cache = torch.zeros(2, 4, 16, 2, 64, device=kernel_device)
    key = torch.zeros(3, 2, 64, device=kernel_device)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key, key, cache[0], cache[1], torch.zeros(2, dtype=torch.int64, device=kernel_device))
    with pytest.raises(ValueError, match="cache"):
        write_kv(key[:, :1], key[:, :1], cache[0], cache[1], torch.zeros(3, dtype=torch.int64, device=kernel_device))
