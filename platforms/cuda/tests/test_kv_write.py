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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size", [(32, 8, 128, 16), (4, 2, 64, 16), (6, 3, 96, 5)])
def test_rotary_write_kv_equals_rotary_then_write(
    dtype, num_heads, num_kv_heads, head_size, block_size, kernel_device, check_dtype
):
    """The fused pass gives the bits of the platform's rotary op followed by a cache write, and
    matches the contract's reference rotary to within 2 ulps; other slots are untouched."""
    from podium_cuda.fused_ops import rotary_embedding
    from podium_cuda.kv_write import rotary_write_kv
    from podium_cuda.testing import ULP2
    from podium_plugin_api import ops

    check_dtype(dtype)
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    backend, dev = AttentionBackend(), kernel_device
    spec = KVCacheSpec(1, num_kv_heads, head_size, block_size, dtype)
    num_blocks, num_tokens, max_pos = 12, 40, 300
    start = torch.randn(backend.kv_cache_shape(spec, num_blocks), generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:7]] = -1  # padding tokens: nothing written
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    angles = torch.rand(max_pos, head_size // 2, generator=gen) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [max_pos, D] float32
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).view(num_tokens, -1, head_size)
    q, k, v = (t.to(dev) for t in qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1))  # views of one tensor
    positions, cos_sin, slots_dev = positions.to(dev), cos_sin.to(dev), slots.to(dev)

    q_rot, k_rot = rotary_embedding(positions, q, k, cos_sin)  # the unfused platform path
    expected = start.clone().to(dev)
    backend.write_kv(expected, k_rot, v, slots_dev)
    cache = start.clone().to(dev)
    q_out = rotary_write_kv(positions, q, k, v, cos_sin, *backend.split_cache(cache), slots_dev)
    assert torch.equal(q_out, q_rot), f"seed {seed}"
    assert torch.equal(cache, expected), f"seed {seed}"
    q_ref, k_ref = ops.rotary_embedding(positions.cpu(), q.cpu(), k.cpu(), cos_sin.cpu())
    torch.testing.assert_close(q_out.cpu(), q_ref, **ULP2[dtype])
    kept = slots >= 0
    k_back, v_back = backend.read_kv(cache.cpu(), slots[kept])
    torch.testing.assert_close(k_back, k_ref[kept], **ULP2[dtype])
    assert torch.equal(v_back, v.cpu()[kept])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[kept]] = False
    flat, flat_start = cache.cpu().view(2, -1, num_kv_heads, head_size), start.view(2, -1, num_kv_heads, head_size)
    assert torch.equal(flat[:, untouched], flat_start[:, untouched])  # padding and other slots keep their bits


def test_rotary_write_kv_rejects_mismatched_shapes(kernel_device):
    from podium_cuda.kv_write import rotary_write_kv

    cache = torch.zeros(2, 4, 16, 2, 64, device=kernel_device)
    q, k = torch.zeros(3, 4, 64, device=kernel_device), torch.zeros(3, 2, 64, device=kernel_device)
    pos = torch.zeros(3, dtype=torch.int64, device=kernel_device)
    cos_sin = torch.zeros(10, 64, device=kernel_device)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_write_kv(pos, q, k, k, cos_sin, cache[0], cache[1], pos[:2])
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_write_kv(pos, q, k, k, cos_sin[:, :32], cache[0], cache[1], pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", [((1, 30), (1, 7), (1, 45)), ((5, 5), (1, 17), (9, 40))])  # (new tokens, length)
def test_forward_rotary_equals_rotary_then_forward(dtype, seqs, kernel_device, check_dtype):
    """The backend's fused path (one rotary + cache write pass, then attention) against the
    platform's rotary op then ``forward``: same outputs, same cache, bit for bit."""
    from podium_cuda.attention import TritonAttentionBackend
    from podium_cuda.fused_ops import rotary_embedding
    from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, RotaryInputs

    check_dtype(dtype)
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    backend, dev = TritonAttentionBackend(), kernel_device
    heads, kv_heads, head_size, block_size, num_blocks = 8, 2, 64, 16, 16
    layer = AttentionLayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=head_size, scale=head_size**-0.5)
    spec = KVCacheSpec(1, kv_heads, head_size, block_size, dtype)
    start = torch.randn(backend.kv_cache_shape(spec, num_blocks), generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-length // block_size))] for _, length in seqs]
    meta = AttentionMetadata.from_lengths([new for new, _ in seqs], [length for _, length in seqs], tables,
                                          block_size, device=dev)
    positions = [p for new, length in seqs for p in range(length - new, length)]
    tokens = len(positions)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype).view(tokens, -1, head_size)
    q, k, v = (t.to(dev) for t in qkv.split([heads, kv_heads, kv_heads], dim=1))
    angles = torch.rand(64, head_size // 2, generator=gen) * 6.3
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dev)
    pos = torch.tensor(positions, device=dev)
    fused_cache, plain_cache = start.clone().to(dev), start.clone().to(dev)
    got = backend.forward_rotary(layer, q, k, v, fused_cache, meta, RotaryInputs(pos, table, rotary_embedding))
    q_rot, k_rot = rotary_embedding(pos, q, k, table)
    want = backend.forward(layer, q_rot, k_rot, v, plain_cache, meta)
    assert torch.equal(got, want) and torch.equal(fused_cache, plain_cache)
