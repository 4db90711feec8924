"""The platform's fused ops against the contract's pure-torch reference ops."""

from __future__ import annotations

import random

import pytest
import torch

from podium_plugin_api import ops as reference

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# two roundings of the output dtype: a fused exp/rsqrt may round an intermediate the other way
ULP2 = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 1e-4},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3}}


def _randn(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm_and_fused_add(dtype, hidden, kernel_device, check_dtype):
    from podium_cuda.fused_ops import fused_add_rms_norm, rms_norm

    check_dtype(dtype)
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    x = _randn(gen, 37, hidden, dtype=dtype, device=kernel_device, scale=3.0)
    residual = _randn(gen, 37, hidden, dtype=dtype, device=kernel_device)
    weight = _randn(gen, hidden, dtype=dtype, device=kernel_device)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **ULP2[dtype])
    normed, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **ULP2[dtype])
    fp32_weight = weight.float()  # weight dtype decides the output dtype, as in the reference
    out = rms_norm(x[:5], fp32_weight, 1e-6)
    assert out.dtype == reference.rms_norm(x[:5], fp32_weight, 1e-6).dtype
    torch.testing.assert_close(out, reference.rms_norm(x[:5], fp32_weight, 1e-6), **ULP2[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_size", [((32, 8), 128), ((9, 3), 64), ((4, 1), 80)])
def test_rotary_embedding_on_fused_qkv_views(dtype, heads, head_size, kernel_device, check_dtype):
    from podium_cuda.fused_ops import rotary_embedding

    check_dtype(dtype)
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    num_tokens, (num_heads, num_kv_heads) = 29, heads
    max_pos = 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=kernel_device)
    qkv = _randn(gen, num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device=kernel_device)
    query = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    key = qkv[:, num_heads * head_size: (num_heads + num_kv_heads) * head_size].view(num_tokens, num_kv_heads, head_size)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(kernel_device)
    q, k = rotary_embedding(positions, query, key, cache)
    ref_q, ref_k = reference.rotary_embedding(positions, query, key, cache)
    torch.testing.assert_close(q, ref_q, **ULP2[dtype])
    torch.testing.assert_close(k, ref_k, **ULP2[dtype])
    assert torch.equal(qkv[:, : num_heads * head_size].view_as(query), query)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 14336, 100])
def test_silu_and_mul(dtype, inter, kernel_device, check_dtype):
    from podium_cuda.fused_ops import silu_and_mul

    check_dtype(dtype)
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    x = _randn(gen, 19, 2 * inter, dtype=dtype, device=kernel_device, scale=4.0)
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), **ULP2[dtype])


def test_platform_installs_only_known_ops_with_reference_signatures(kernel_device):
    from podium_cuda import CudaPlatform

    table = CudaPlatform().custom_ops()
    assert set(table) <= set(reference.REFERENCE_OPS)
    built = reference.build_op_table(table)
    x = torch.randn(4, 64, device=kernel_device)
    torch.testing.assert_close(built["rms_norm"](x, torch.ones(64, device=kernel_device), 1e-6),
                               reference.rms_norm(x, torch.ones(64, device=kernel_device), 1e-6))
