"""Triton KV write by slot mapping: round trip through read_kv, skipped slots, untouched cache."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from podium_cuda.tuning import CUDA_TUNING
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
    from cuda_checks import ULP2

    from podium_cuda.fused_ops import rotary_embedding
    from podium_cuda.kv_write import rotary_write_kv
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
    """The backend's fused path against the platform's rotary op then ``forward``: the same cache
    bit for bit; the same output bit for bit where a step has prefill tokens (rotary + write pass,
    then attention), within rounding for a pure-decode step (rotary, write and attention in one
    kernel, which adds the new key to the softmax in another order)."""
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
    assert torch.equal(fused_cache, plain_cache)
    if meta.is_pure_decode and backend.tuning.decode_rotary_in_attention:
        from cuda_checks import relative_error

        whole, worst = relative_error(got, want)
        assert whole < NEW_TOKEN_TOLERANCE[dtype][0] and worst < NEW_TOKEN_TOLERANCE[dtype][1], (whole, worst)
    else:
        assert torch.equal(got, want)


# dtype -> (whole-batch, worst-token) relative error between the one-kernel decode and the two-kernel path
NEW_TOKEN_TOLERANCE = {torch.float32: (1e-5, 5e-5), torch.float16: (2e-3, 8e-3), torch.bfloat16: (1.2e-2, 3e-2)}

NEW_TOKEN_CASES = [  # heads (H, Hkv), head_size, block_size, window, cap, num_splits, dtype
    ((32, 8), 128, 16, None, None, 1, torch.bfloat16),
    ((32, 8), 128, 16, None, None, 4, torch.bfloat16),
    ((32, 8), 128, 16, None, None, 4, torch.float32),
    ((16, 16), 64, 16, None, None, 2, torch.float16),  # group 1
    ((8, 1), 64, 16, None, None, 8, torch.float32),  # MQA, group 8
    ((12, 4), 96, 5, None, None, 2, torch.float32),  # group 3, padded head size, odd block size
    ((16, 4), 128, 16, 20, None, 4, torch.float32),  # sliding window
    ((16, 4), 64, 16, None, 2.0, 2, torch.float32),  # soft cap
    ((32, 8), 128, 16, None, None, 4, torch.bfloat16, torch.float8_e4m3fn),  # fp8 caches
    ((32, 8), 128, 16, None, None, 1, torch.float16, torch.float8_e5m2),
]


# the decode tilings (KernelTuning): the defaults, and swapped (the fp8 one over other caches and
# the other way round)
DECODE_OPTIONS = {
    "default": {},
    "swapped": {"decode": CUDA_TUNING.fp8_decode or CUDA_TUNING.decode, "fp8_decode": CUDA_TUNING.decode},
}


def _case_id(c) -> str:
    return f"{c[0][0]}x{c[0][1]}-d{c[1]}-b{c[2]}-w{c[3]}-c{c[4]}-s{c[5]}-" + "-".join(str(t)[6:] for t in c[6:])


# every case at the default tilings; swapped on bf16, fp16 group 1, MQA and fp8 cases
NEW_TOKEN_RUNS = [(c, "default") for c in NEW_TOKEN_CASES] + [
    (NEW_TOKEN_CASES[i], name) for name in list(DECODE_OPTIONS)[1:] for i in (0, 3, 4, 8)]


@pytest.mark.parametrize("case,options", NEW_TOKEN_RUNS, ids=[f"{_case_id(c)}-{o}" for c, o in NEW_TOKEN_RUNS])
def test_decode_with_new_tokens_equals_write_then_attend(case, options, kernel_device, check_dtype):
    """``paged_attention(new_tokens=...)`` (rotary, cache write and attention in one kernel) against
    ``rotary_write_kv`` then ``paged_attention``, and against the float64 reference: the same cache
    bits (padding slot -1 untouched), outputs within rounding, every real row of a NaN-poisoned
    output written. Lengths: a sequence's first token (nothing cached), block edges, long. An fp8
    cache (8th field): the same bits, and the reference reads the fp8 values. Each of the decode
    tilings (``DECODE_OPTIONS``) gives the same."""
    from cuda_checks import cache_bits, relative_error

    from podium_cuda.kv_write import rotary_write_kv
    from podium_cuda.paged_attention import NewTokens, paged_attention
    from podium_plugin_api import AttentionMetadata, reference_paged_attention

    (heads, kv_heads), head_size, block_size, window, cap, num_splits, dtype, *cache_dtype = case
    check_dtype(dtype)
    seed = random.randrange(1 << 30)
    rng, gen, dev = random.Random(seed), torch.Generator().manual_seed(seed), kernel_device
    lens = [1, block_size, block_size + 1, rng.randint(2, 60), rng.randint(200, 400), 1]  # the last: padding
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = AttentionMetadata.from_lengths([1] * len(lens), lens, tables, block_size, device=dev)
    meta.slot_mapping[-1] = -1
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype).view(len(lens), -1, head_size)
    q, k, v = (t.to(dev) for t in qkv.split([heads, kv_heads, kv_heads], dim=1))  # strided views, like the model's
    angles = torch.rand(512, head_size // 2, generator=gen) * 6.3
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dev)
    pos = torch.tensor(lens, device=dev) - 1
    start = torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=gen).to(*cache_dtype or [dtype]).to(dev)
    args = dict(scale=head_size**-0.5, max_query_len=1, sliding_window=window, soft_cap=cap, num_splits=num_splits)
    tuning = replace(CUDA_TUNING, **DECODE_OPTIONS[options])

    plain = start.clone()
    q_rot = rotary_write_kv(pos, q, k, v, table, plain[0], plain[1], meta.slot_mapping)
    want = paged_attention(q_rot, plain[0], plain[1], meta.query_start_loc, meta.seq_lens, meta.block_tables, **args)
    fused = start.clone()
    got = torch.full_like(q_rot, float("nan"))
    paged_attention(q, fused[0], fused[1], meta.query_start_loc, meta.seq_lens, meta.block_tables, out=got,
                    new_tokens=NewTokens(pos, k, v, table, meta.slot_mapping), tuning=tuning, **args)
    assert torch.equal(cache_bits(fused), cache_bits(plain)), \
        f"seed {seed}: the kernel's cache write differs from rotary_write_kv's"
    assert torch.isfinite(got).all(), f"seed {seed}: rows left unwritten"
    real = slice(0, len(lens) - 1)  # the padding row attends to its own unstored key: not compared
    whole, worst = relative_error(got[real], want[real])
    tol = NEW_TOKEN_TOLERANCE[dtype]
    assert whole < tol[0] and worst < tol[1], f"seed {seed} lens {lens}: {whole:.2e} {worst:.2e}"
    ref_meta = AttentionMetadata.from_lengths([1] * (len(lens) - 1), lens[:-1], tables[:-1], block_size, device="cpu")
    cache = plain.cpu().double()
    ref = reference_paged_attention(q_rot[real].cpu().double(), cache[0], cache[1], ref_meta, scale=args["scale"],
                                    sliding_window=window, soft_cap=cap, compute_dtype=torch.float64)
    whole, worst = relative_error(got[real], ref)
    tol = {torch.float32: (2e-5, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (1.5e-2, 4e-2)}[dtype]
    assert whole < tol[0] and worst < tol[1], f"seed {seed} lens {lens} vs reference: {whole:.2e} {worst:.2e}"


def test_new_tokens_need_a_decode_step_and_matching_shapes(kernel_device):
    from podium_cuda.paged_attention import NewTokens, paged_attention
    from podium_plugin_api import AttentionMetadata

    dev = kernel_device
    meta = AttentionMetadata.from_lengths([1, 1], [5, 9], [[0], [1]], 16, device=dev)
    cache = torch.zeros(2, 2, 16, 2, 64, device=dev)
    q, k = torch.zeros(2, 4, 64, device=dev), torch.zeros(2, 2, 64, device=dev)
    pos, table = torch.zeros(2, dtype=torch.int64, device=dev), torch.zeros(16, 64, device=dev)
    call = dict(scale=0.125, max_query_len=1)
    with pytest.raises(ValueError, match="new key"):
        paged_attention(q, cache[0], cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                        new_tokens=NewTokens(pos, k[:, :1], k[:, :1], table, meta.slot_mapping), **call)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        paged_attention(q, cache[0], cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                        new_tokens=NewTokens(pos, k, k, table[:, :32], meta.slot_mapping), **call)
    with pytest.raises(ValueError, match="pure-decode"):
        paged_attention(q, cache[0], cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables, scale=0.125,
                        max_query_len=2, new_tokens=NewTokens(pos, k, k, table, meta.slot_mapping))
