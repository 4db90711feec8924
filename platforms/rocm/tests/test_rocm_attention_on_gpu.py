"""The rocm platform's attention on a GPU (forced onto CUDA where no AMD GPU is), against the
contract's float64 reference: random ragged batches with prefix hits, GQA groups 1/3/4/8 and MQA,
sliding windows, soft caps, odd block sizes; split decodes and NaN-poisoned outputs; KV writes;
graph replay against eager. The same checks as the CUDA platform's tests, through the ROCm path.
"""

from __future__ import annotations

import random

import pytest
import torch
from cuda_checks import check_decode_graph_replay

from podium_plugin_api import AttentionBackend, AttentionLayerSpec, KVCacheSpec

pytestmark = pytest.mark.cuda

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CASES = [
    # kind, num_seqs, max_len, (H, Hkv), head_size, block_size, window, soft_cap, dtype
    # float32 prefill kernels (exact IEEE dots) take Triton far longer to compile than 16-bit ones, so
    # the float32 cases share compiled shapes: the MHA one with the conformance kit's "mha" case (group
    # 1, head 64, block 32), the window + cap one with test_prefill_fills_a_poisoned_output_with_window_and_cap.
    ("decode", 6, 300, (32, 8), 128, 16, None, None, BF16),  # GQA 4
    ("prefill", 4, 150, (32, 4), 128, 16, None, None, BF16),  # GQA 8
    ("prefix", 5, 200, (16, 4), 128, 16, None, None, F16),  # prefix hits
    ("boundary", 6, 96, (8, 8), 64, 32, None, None, F32),  # GQA 1 (MHA)
    ("mixed", 8, 180, (16, 2), 64, 16, None, None, BF16),
    ("mixed", 8, 180, (8, 8), 128, 32, None, None, F16),  # MHA, head 128
    ("mixed", 6, 160, (8, 1), 64, 16, None, None, F16),  # MQA
    ("mixed", 6, 200, (16, 4), 128, 16, 40, None, BF16),  # sliding window
    ("prefix", 6, 300, (32, 8), 128, 8, 64, None, F16),  # window over a cached prefix
    ("mixed", 6, 200, (8, 2), 64, 16, 17, 2.0, F32),  # window and soft cap
    ("mixed", 6, 120, (32, 4), 128, 16, None, 1.5, BF16),  # soft cap, GQA 8
    ("mixed", 5, 100, (12, 4), 96, 16, None, None, F16),  # group 3, head size padded to 128
    ("mixed", 4, 100, (8, 2), 256, 16, None, None, BF16),  # head 256: the launcher halves the rows
    ("boundary", 5, 70, (8, 1), 64, 7, None, None, F32),  # odd block size, MQA
]


def case_id(c) -> str:
    return f"{c[0]}-{c[3][0]}x{c[3][1]}-d{c[4]}-b{c[5]}-w{c[6]}-c{c[7]}-{str(c[8]).replace('torch.', '')}"


def layer_of(heads, head_size, window=None, cap=None) -> AttentionLayerSpec:
    return AttentionLayerSpec(heads[0], heads[1], head_size, head_size**-0.5, sliding_window=window, soft_cap=cap)


def test_the_platform_runs_its_own_path(rocm_platform):
    """What the rest of this file exercises: the ROCm backend with the ROCm table, HIP/CUDA graphs."""
    from podium_rocm.attention import RocmAttentionBackend

    backend = rocm_platform.attention_backend()
    assert isinstance(backend, RocmAttentionBackend)
    assert backend.tuning == rocm_platform.tuning()
    assert backend.tuning.prefill.num_stages == backend.tuning.decode.num_stages == 1  # the ROCm table's
    assert rocm_platform.capabilities().graph_capture and rocm_platform.graph_runner() is not None


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_forward_matches_reference(case, rocm_platform, make_step, make_lengths, check_output):
    kind, num_seqs, max_len, heads, head_size, block_size, window, cap, dtype = case
    seed = random.randrange(1 << 30)  # fresh inputs each run; the seed is in the failure message
    query_lens, seq_lens = make_lengths(random.Random(seed), num_seqs, max_len, kind, block_size)
    step = make_step(query_lens, seq_lens, heads=heads, head_size=head_size, block_size=block_size,
                     dtype=dtype, seed=seed)
    layer = layer_of(heads, head_size, window, cap)
    query, key, value, cache = step.on_device()
    out = rocm_platform.attention_backend().forward(layer, query, key, value, cache, step.meta)
    expected_cache, expected = step.reference(layer)
    assert out.dtype == dtype and out.shape == query.shape
    assert torch.equal(cache.cpu(), expected_cache), f"KV write, {step.description}"
    check_output(out, expected, dtype, step.description)


@pytest.mark.parametrize("num_splits", [1, 2, 8, 32])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_split_decode_fills_a_poisoned_output(num_splits, dtype, rocm_platform, make_step, check_output):
    """Flash-decoding splits with the ROCm launch table (some splits empty for the short sequences)."""
    from podium_cuda.paged_attention import paged_attention

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    seq_lens = [rng.randint(900, 1500), 1, rng.randint(2, 40), rng.randint(200, 700)]
    step = make_step([1] * 4, seq_lens, heads=(16, 4), head_size=128, block_size=16, dtype=dtype, seed=seed)
    layer = layer_of((16, 4), 128)
    query, key, value, cache = step.on_device()
    AttentionBackend().write_kv(cache, key, value, step.meta.slot_mapping)
    out = torch.full_like(query, float("nan"))
    paged_attention(query, cache[0], cache[1], step.meta.query_start_loc, step.meta.seq_lens, step.meta.block_tables,
                    scale=layer.scale, max_query_len=1, num_splits=num_splits, out=out,
                    tuning=rocm_platform.attention_backend().tuning)
    check_output(out, step.reference(layer)[1], dtype, f"{num_splits} splits, {step.description}")


def test_long_decode_splits_under_the_rocm_policy(rocm_platform, make_step, check_output):
    backend = rocm_platform.attention_backend()
    seed = random.randrange(1 << 30)
    step = make_step([1, 1], [3000, 2200], heads=(32, 8), head_size=128, block_size=16, dtype=BF16, seed=seed)
    assert backend.num_splits(step.meta, 8) > 1
    query, key, value, cache = step.on_device()
    out = backend.forward(layer_of((32, 8), 128), query, key, value, cache, step.meta)
    check_output(out, step.reference(layer_of((32, 8), 128))[1], BF16, step.description)


def test_prefill_fills_a_poisoned_output_with_window_and_cap(rocm_platform, make_step, check_output):
    """Every row of a mixed batch is written (NaN-poisoned output first), window and cap on."""
    from podium_cuda.paged_attention import paged_attention

    seed = random.randrange(1 << 30)
    query_lens, seq_lens = [1, 37, 64, 3, 129], [50, 37, 100, 3, 200]
    step = make_step(query_lens, seq_lens, heads=(8, 2), head_size=64, block_size=16, dtype=F32, seed=seed)
    layer = layer_of((8, 2), 64, 24, 3.0)
    query, key, value, cache = step.on_device()
    AttentionBackend().write_kv(cache, key, value, step.meta.slot_mapping)
    out = torch.full_like(query, float("nan"))
    paged_attention(query, cache[0], cache[1], step.meta.query_start_loc, step.meta.seq_lens, step.meta.block_tables,
                    scale=layer.scale, max_query_len=max(query_lens), sliding_window=24, soft_cap=3.0, out=out,
                    tuning=rocm_platform.attention_backend().tuning)
    check_output(out, step.reference(layer)[1], F32, step.description)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("num_kv_heads,head_size,block_size", [(8, 128, 16), (3, 96, 5), (1, 256, 32)])
def test_kv_write_skips_padding_and_reads_back(
    dtype, num_kv_heads, head_size, block_size, rocm_platform, device, check_dtype
):
    check_dtype(dtype)
    backend = rocm_platform.attention_backend()
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(1, num_kv_heads, head_size, block_size, dtype)
    num_blocks, num_tokens = 12, 40
    start = torch.randn(backend.kv_cache_shape(spec, num_blocks), generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:7]] = -1  # padding tokens: not written
    # key/value as views of a fused qkv projection (token stride > Hkv * D), fp32 source for dtype casts
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_size, generator=gen)
    width = num_kv_heads * head_size
    key = qkv[:, width: 2 * width].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, 2 * width:].view(num_tokens, num_kv_heads, head_size)
    expected = start.clone()
    AttentionBackend().write_kv(expected, key, value, slots)
    cache = start.to(device, copy=True)
    backend.write_kv(cache, key.to(device), value.to(device), slots.to(device))
    assert torch.equal(cache.cpu(), expected), f"seed {seed}"
    kept = slots >= 0
    k_back, v_back = backend.read_kv(cache, slots[kept].to(device))
    assert torch.equal(k_back.cpu(), key[kept].to(dtype)) and torch.equal(v_back.cpu(), value[kept].to(dtype))


def test_decode_graph_replay_equals_eager(rocm_platform, gpu):
    """A decode step captured with the platform's graph runner (HIP graphs on ROCm) replays exactly
    like eager: the CUDA platform's check (cuda_checks) through the ROCm backend and runner,
    with ``forward`` and with ``forward_rotary`` (rotary + cache write + attention in one kernel)."""
    check_decode_graph_replay(rocm_platform, gpu)
    check_decode_graph_replay(rocm_platform, gpu, rotary=True)
