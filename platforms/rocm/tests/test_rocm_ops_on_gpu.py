"""The rocm platform's fused ops on a GPU against the contract's reference ops (the CUDA platform's
checks, from ``cuda_checks``, run on the ops the ROCm tuning launches), and proof that the
kernels Triton compiled in this process carry the ROCm table's launch parameters."""

from __future__ import annotations

import random

import cuda_checks as checks
import pytest
import torch

from podium_plugin_api import AttentionLayerSpec
from podium_plugin_api import ops as reference

pytestmark = pytest.mark.cuda


@pytest.fixture
def ops(rocm_platform):
    return rocm_platform.custom_ops()


def test_the_platform_installs_the_tables_fused_ops(rocm_platform, ops):
    assert sorted(ops) == sorted(rocm_platform.tuning().fused_ops)
    assert set(ops) <= set(reference.REFERENCE_OPS)


@pytest.mark.parametrize("dtype", checks.FUSED_OP_DTYPES)
@pytest.mark.parametrize("hidden", checks.RMS_NORM_HIDDEN)
def test_rms_norm_and_fused_add(dtype, hidden, ops, device, check_dtype):
    check_dtype(dtype)
    checks.check_rms_norm(ops, dtype, hidden, device, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("dtype", checks.FUSED_OP_DTYPES)
@pytest.mark.parametrize("heads,head_size", checks.ROTARY_SHAPES)
def test_rotary_embedding_on_fused_qkv_views(dtype, heads, head_size, ops, device, check_dtype):
    check_dtype(dtype)
    checks.check_rotary_embedding(ops, dtype, heads, head_size, device, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("dtype", checks.FUSED_OP_DTYPES)
@pytest.mark.parametrize("inter", checks.SILU_INTER)
def test_silu_and_mul(dtype, inter, ops, device, check_dtype):
    check_dtype(dtype)
    checks.check_silu_and_mul(ops, dtype, inter, device, seed=random.randrange(1 << 30))


def compiled_variants(kernel) -> set[tuple[int, int]]:
    """(num_warps, num_stages) of every variant Triton compiled for ``kernel`` in this process.

    Reads Triton's per-device kernel cache (``JITFunction.device_caches``; the first item of each
    entry maps specialisation keys to compiled kernels, whose metadata holds the launch options).
    """
    caches = getattr(kernel, "device_caches", None)
    if not isinstance(caches, dict) or not caches:
        pytest.skip("this Triton keeps no device_caches on its kernels; test_rocm_tuning.py checks the launches")
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
