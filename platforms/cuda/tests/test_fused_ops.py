"""The platform's fused ops against the contract's pure-torch reference ops.

The checks live in ``cuda_checks``: the ROCm platform runs the same ones with its tuning.
"""

from __future__ import annotations

import random

import cuda_checks as checks
import pytest
import torch

from podium_plugin_api import ops as reference

pytestmark = pytest.mark.cuda


@pytest.fixture
def ops():
    from podium_cuda import CudaPlatform

    return CudaPlatform().custom_ops()


@pytest.mark.parametrize("dtype", checks.FUSED_OP_DTYPES)
@pytest.mark.parametrize("hidden", checks.RMS_NORM_HIDDEN)
def test_rms_norm_and_fused_add(dtype, hidden, ops, kernel_device, check_dtype):
    check_dtype(dtype)
    checks.check_rms_norm(ops, dtype, hidden, kernel_device, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("dtype", checks.FUSED_OP_DTYPES)
@pytest.mark.parametrize("heads,head_size", checks.ROTARY_SHAPES)
def test_rotary_embedding_on_fused_qkv_views(dtype, heads, head_size, ops, kernel_device, check_dtype):
    check_dtype(dtype)
    checks.check_rotary_embedding(ops, dtype, heads, head_size, kernel_device, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("dtype", checks.FUSED_OP_DTYPES)
@pytest.mark.parametrize("inter", checks.SILU_INTER)
def test_silu_and_mul(dtype, inter, ops, kernel_device, check_dtype):
    check_dtype(dtype)
    checks.check_silu_and_mul(ops, dtype, inter, kernel_device, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("dtype", checks.FUSED_OP_DTYPES)
@pytest.mark.parametrize("rows,vocab", checks.ARGMAX_SHAPES)
def test_argmax_is_torchs_first_maximum(dtype, rows, vocab, kernel_device):
    from podium_cuda.fused_ops import FUSED_OPS  # checked whether or not the tuning installs it

    checks.check_argmax(FUSED_OPS, dtype, rows, vocab, kernel_device, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("dtype", checks.FUSED_OP_DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 100), (5, 2085), (3, 4096)])
def test_token_bitmask_equals_reference(dtype, rows, vocab, kernel_device):
    from podium_cuda.token_bitmask import apply_token_bitmask

    checks.check_token_bitmask(apply_token_bitmask, dtype, rows, vocab, kernel_device, seed=random.randrange(1 << 30))


def test_platform_installs_only_known_ops_with_reference_signatures(ops, kernel_device):
    assert set(ops) <= set(reference.REFERENCE_OPS)
    built = reference.build_op_table(ops)
    x = torch.randn(4, 64, device=kernel_device)
    torch.testing.assert_close(built["rms_norm"](x, torch.ones(64, device=kernel_device), 1e-6),
                               reference.rms_norm(x, torch.ones(64, device=kernel_device), 1e-6))
