"""fp8 KV caches (``kv_cache_dtype="fp8"``): the Triton kernels store what torch's cast stores and
attend over it like the float64 reference over the same (upcast) cache. (The one-kernel decode
with an fp8 cache: test_kv_write's new-token cases.)

Every store is checked bit for bit against the torch definition (the reference backend's write:
``key.to(cache dtype)``, round to nearest, saturating), values beyond the format's range included.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from cuda_checks import cache_bits, check_decode_graph_replay, relative_error
from triton_interpreter import skip_interpreted_fp8_store

from podium_plugin_api import AttentionBackend, AttentionLayerSpec, AttentionMetadata, reference_paged_attention

pytestmark = pytest.mark.cuda

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MODEL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# query dtype -> (whole-batch, worst-token) relative error against the float64 reference over the fp8 cache
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (1.5e-2, 4e-2)}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _backend():
    from podium_cuda.attention import TritonAttentionBackend

    return TritonAttentionBackend(fp8_flavour="e4m3fn")


def _fp8_cache(shape, cache_dtype, gen, device):
    return (torch.randn(shape, generator=gen) * 2).to(cache_dtype).to(device)


def test_backend_lists_fp8_only_where_told():
    from podium_cuda.attention import TritonAttentionBackend

    assert TritonAttentionBackend().kv_cache_dtypes(torch.bfloat16) == (torch.bfloat16,)
    assert _backend().kv_cache_dtypes(torch.bfloat16) == (torch.bfloat16, *FP8)
    assert _backend().kv_cache_dtypes(torch.float64) == (torch.float64,)  # no kernel: the reference only


@pytest.mark.parametrize("cache_dtype", FP8, ids=_name)
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=_name)
def test_write_kv_stores_the_torch_cast_bit_for_bit(dtype, cache_dtype, kernel_device, check_dtype):
    from podium_plugin_api import KVCacheSpec

    check_dtype(dtype)
    skip_interpreted_fp8_store(kernel_device)
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_size, block_size, num_blocks, num_tokens = 4, 128, 16, 10, 30
    spec = KVCacheSpec(1, num_kv_heads, head_size, block_size, cache_dtype)
    start = torch.randn(_backend().kv_cache_shape(spec, num_blocks), generator=gen).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[:3] = -1
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    key[5] *= 1e5  # beyond both formats' largest value (448 / 57344): saturates
    key[6, 0, :4] = torch.tensor([2.0**-10, -(2.0**-17), 1e-30, 0.0])  # e4m3 subnormals, underflow
    key, value = key.to(dtype), (torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 30).to(dtype)
    expected = start.clone()
    AttentionBackend().write_kv(expected, key, value, slots)  # torch's cast on the CPU
    cache = start.to(kernel_device)
    _backend().write_kv(cache, key.to(kernel_device), value.to(kernel_device), slots.to(kernel_device))
    assert torch.equal(cache_bits(cache.cpu()), cache_bits(expected)), f"seed {seed}"


@pytest.mark.parametrize("cache_dtype", FP8, ids=_name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_name)
def test_rotary_write_kv_stores_the_rotated_key_rounded_then_cast(dtype, cache_dtype, kernel_device, check_dtype):
    """The fused rotary + write stores what the rotary op's output (model dtype), cast, would be."""
    from podium_cuda.fused_ops import rotary_embedding
    from podium_cuda.kv_write import rotary_write_kv

    check_dtype(dtype)
    skip_interpreted_fp8_store(kernel_device)
    seed = random.randrange(1 << 30)
    gen, dev = torch.Generator().manual_seed(seed), kernel_device
    num_tokens, heads, kv_heads, head_size, block_size, num_blocks = 24, 8, 2, 128, 16, 6
    q = torch.randn(num_tokens, heads, head_size, generator=gen).to(dtype).to(dev)
    k = (torch.randn(num_tokens, kv_heads, head_size, generator=gen) * 8).to(dtype).to(dev)
    v = torch.randn(num_tokens, kv_heads, head_size, generator=gen).to(dtype).to(dev)
    angles = torch.rand(256, head_size // 2, generator=gen) * 6.3
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dev)
    pos = torch.randint(0, 256, (num_tokens,), generator=gen).to(dev)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(dev)
    start = _fp8_cache((2, num_blocks, block_size, kv_heads, head_size), cache_dtype, gen, dev)
    q_ref, k_ref = rotary_embedding(pos, q, k, table)
    expected = start.clone()
    AttentionBackend().write_kv(expected, k_ref, v, slots)
    fused = start.clone()
    q_out = rotary_write_kv(pos, q, k, v, table, fused[0], fused[1], slots)
    assert torch.equal(q_out, q_ref), f"seed {seed}"
    assert torch.equal(cache_bits(fused), cache_bits(expected)), f"seed {seed}"


ATTEND_CASES = [  # kind, num_seqs, max_len, heads (H, Hkv), head_size, block_size, window, query dtype, cache dtype
    ("decode", 6, 300, (32, 8), 128, 16, None, torch.bfloat16, torch.float8_e4m3fn),
    ("prefill", 4, 150, (32, 8), 128, 16, None, torch.bfloat16, torch.float8_e4m3fn),
    ("mixed", 8, 180, (16, 2), 64, 16, None, torch.float16, torch.float8_e4m3fn),
    ("mixed", 6, 200, (16, 4), 128, 16, 40, torch.bfloat16, torch.float8_e5m2),
    ("mixed", 5, 100, (12, 4), 96, 5, None, torch.float32, torch.float8_e4m3fn),  # group 3, odd block size
]


@pytest.mark.parametrize("case", ATTEND_CASES, ids=[f"{c[0]}-{c[3][0]}x{c[3][1]}-d{c[4]}-b{c[5]}-w{c[6]}-"
                                                     f"{_name(c[7])}-{_name(c[8])}" for c in ATTEND_CASES])
def test_attention_over_fp8_cache_matches_reference(case, kernel_device, check_dtype, make_lengths):
    from podium_cuda.attention import TritonAttentionBackend
    from podium_cuda.tuning import CUDA_TUNING

    kind, num_seqs, max_len, heads, head_size, block_size, window, dtype, cache_dtype = case
    check_dtype(dtype)
    seed = random.randrange(1 << 30)
    rng, gen, dev = random.Random(seed), torch.Generator().manual_seed(seed), kernel_device
    query_lens, seq_lens = make_lengths(rng, num_seqs, max_len, kind, block_size)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size, device=dev)
    cache = _fp8_cache((2, num_blocks, block_size, heads[1], head_size), cache_dtype, gen, dev)
    query = torch.randn(sum(query_lens), heads[0], head_size, generator=gen).to(dtype).to(dev)
    layer = AttentionLayerSpec(heads[0], heads[1], head_size, head_size**-0.5, sliding_window=window)
    ref_meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size, device="cpu")
    wide = cache.cpu().double()
    ref = reference_paged_attention(query.cpu().double(), wide[0], wide[1], ref_meta, scale=layer.scale,
                                    sliding_window=window, compute_dtype=torch.float64)
    # bf16 queries: the dots in fp16 (the default) or in bf16; value tiles converted in registers (on
    # sm89+ GPUs; elsewhere Triton's cast either way) or by Triton's cast; block ids loaded in the loop
    # or from 4 / 64 table entries in registers
    for fp16_dot, convert, table in ((True, True, 0), (False, True, 0), (True, False, 0), (False, False, 0),
                                     (True, True, 4), (True, True, 64)):
        tilings = {name: replace(getattr(CUDA_TUNING, name) or CUDA_TUNING.decode, table_blocks=table)
                   for name in ("decode", "prefill", "fp8_decode", "fp8_split_decode", "fp8_prefill")}
        tuning = replace(CUDA_TUNING, fp8_dot_in_fp16=fp16_dot, fp8_values_in_registers=convert, **tilings)
        out = TritonAttentionBackend(tuning, fp8_flavour="e4m3fn").attend(layer, query, cache, meta)
        whole, worst = relative_error(out, ref)
        assert out.dtype == dtype
        assert whole < TOLERANCE[dtype][0] and worst < TOLERANCE[dtype][1], \
            f"seed {seed}, fp8_dot_in_fp16={fp16_dot}, fp8_values_in_registers={convert}, table blocks {table}: " \
            f"{whole:.2e} {worst:.2e}"


@pytest.mark.parametrize("rotary", [False, True], ids=["forward", "forward_rotary"])
def test_decode_graph_replay_with_fp8_cache_equals_eager(gpu, rotary):
    from podium_cuda import CudaPlatform

    platform = CudaPlatform()
    assert torch.float8_e4m3fn in platform.attention_backend().kv_cache_dtypes(torch.bfloat16), \
        "an sm89+ GPU should get fp8 caches"
    check_decode_graph_replay(platform, gpu, rotary=rotary, cache_dtype=torch.float8_e4m3fn)
