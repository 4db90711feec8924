"""The rocm platform's fused ops on a GPU against the contract's reference ops, and proof that the
kernels Triton compiled in this process carry the ROCm table's launch parameters."""

from __future__ import annotations

import random

import pytest
import torch

from podium_plugin_api import AttentionLayerSpec
from podium_plugin_api import ops as reference

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# two roundings of the output dtype: a fused exp/rsqrt may round an intermediate the other way
ULP2 = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 1e-4},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3}}


def _randn(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def test_the_platform_installs_the_tables_fused_ops(rocm_platform):
    ops = rocm_platform.custom_ops()
    assert sorted(ops) == sorted(rocm_platform.tuning().fused_ops)
    assert set(ops) <= set(reference.REFERENCE_OPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])  # 4096: 16 warps, 1024 lanes on a 64-lane wavefront
def test_rms_norm_and_fused_add(dtype, hidden, rocm_platform, device, check_dtype):
    check_dtype(dtype)
    ops = rocm_platform.custom_ops()
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    x = _randn(gen, 37, hidden, dtype=dtype, device=device, scale=3.0)
    residual = _randn(gen, 37, hidden, dtype=dtype, device=device)
    weight = _randn(gen, hidden, dtype=dtype, device=device)
    torch.testing.assert_close(ops["rms_norm"](x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **ULP2[dtype])
    normed, summed = ops["fused_add_rms_norm"](x, residual, weight, 1e-5)
    ref_normed, ref_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **ULP2[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_size", [((32, 8), 128), ((9, 3), 64), ((4, 1), 80)])
def test_rotary_embedding_on_fused_qkv_views(dtype, heads, head_size, rocm_platform, device, check_dtype):
    check_dtype(dtype)
    rotary = rocm_platform.custom_ops()["rotary_embedding"]
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    num_tokens, (num_heads, num_kv_heads), max_pos = 29, heads, 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)
    qkv = _randn(gen, num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device=device)
    query = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    key = qkv[:, num_heads * head_size: (num_heads + num_kv_heads) * head_size].view(num_tokens, num_kv_heads, head_size)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(device)
    q, k = rotary(positions, query, key, cache)
    ref_q, ref_k = reference.rotary_embedding(positions, query, key, cache)
    torch.testing.assert_close(q, ref_q, **ULP2[dtype])
    torch.testing.assert_close(k, ref_k, **ULP2[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 14336, 100])
def test_silu_and_mul(dtype, inter, rocm_platform, device, check_dtype):
    check_dtype(dtype)
    silu_and_mul = rocm_platform.custom_ops()["silu_and_mul"]
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    x = _randn(gen, 19, 2 * inter, dtype=dtype, device=device, scale=4.0)
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), **ULP2[dtype])


def compiled_variants(kernel) -> set[tuple[int, int]]:
    """(num_warps, num_stages) of every variant Triton compiled for ``kernel`` in this process.

    Reads Triton's per-device kernel cache (``JITFunction.device_caches``; the first item of each
    entry maps specialisation keys to compiled kernels, whose metadata holds the launch options).
    """
    caches = getattr(kernel, "device_caches", None)
    if not isinstance(caches, dict) or not caches:
        pytest.skip("this Triton keeps no device_caches on its kernels; tests/test_rocm_tuning.py checks the launches")
    found = set()
    for entry in caches.values():
        for compiled in entry[0].values():
            found.add((int(compiled.metadata.num_warps), int(compiled.metadata.num_stages)))
    return found


def test_compiled_kernels_carry_the_rocm_launch_parameters(rocm_platform, make_step, gpu):
    """Triton compiled the attention kernel with the ROCm tiles' warps and stages (one stage, which
    no CUDA table entry uses) and the KV write with the ROCm warps."""
    from podium_cuda.kv_write import write_kv_kernel
    from podium_cuda.paged_attention import paged_attention_kernel

    backend = rocm_platform.attention_backend()
    tuning = backend.tuning
    layer = AttentionLayerSpec(8, 2, 64, 64**-0.5)
    for query_lens, seq_lens in (([5, 1], [20, 33]), ([1, 1], [20, 33])):  # a prefill step, a decode step
        step = make_step(query_lens, seq_lens, heads=(8, 2), head_size=64, block_size=16, dtype=torch.bfloat16, seed=0)
        query, key, value, cache = step.on_device()
        backend.forward(layer, query, key, value, cache, step.meta)
    torch.cuda.synchronize()
    attention = compiled_variants(paged_attention_kernel)
    for tiling in (tuning.prefill, tuning.decode):
        assert (tiling.num_warps, tiling.num_stages) in attention, attention
    assert tuning.kv_write_num_warps in {warps for warps, _ in compiled_variants(write_kv_kernel)}
