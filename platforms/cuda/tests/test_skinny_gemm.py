"""skinny_linear (few-row linears in Triton) against a float64 ``F.linear``, and SkinnyLinear's dispatch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from podium_cuda.tuning import CUDA_TUNING, KernelTuning, SkinnyTiling

skinny_gemm = pytest.importorskip("podium_cuda.skinny_gemm", reason="needs triton (GPU or TRITON_INTERPRET=1)")
SkinnyLinear, pick_tiling = skinny_gemm.SkinnyLinear, skinny_gemm.pick_tiling
skinny_linear, use_skinny_linears = skinny_gemm.skinny_linear, skinny_gemm.use_skinny_linears

pytestmark = pytest.mark.cuda

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # relative to the output scale
SHAPES = [  # (rows, out, in, bias, tiling or None for the policy's)
    (1, 4096, 4096, False, None),
    (1, 6144, 2048, True, None),
    (2, 1000, 576, False, None),  # out not a multiple of any block
    (3, 200, 1536, True, SkinnyTiling(32, 128, 4, 3)),
    (8, 960, 576, False, SkinnyTiling(16, 64, 4, 2)),
    (16, 129, 300, True, SkinnyTiling(64, 256, 8, 2)),  # in not a multiple of block_k
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k,bias,tiling", SHAPES)
def test_skinny_linear_matches_float64(dtype, rows, n, k, bias, tiling, kernel_device, check_dtype):
    check_dtype(dtype)
    gen = torch.Generator().manual_seed(rows * 7919 + n + k)
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / k**0.5
    b = torch.randn(n, generator=gen, dtype=torch.float64) if bias else None
    expected = F.linear(x.to(dtype).double(), w.to(dtype).double(), b.to(dtype).double() if bias else None)
    got = skinny_linear(x.to(kernel_device, dtype), w.to(kernel_device, dtype),
                        b.to(kernel_device, dtype) if bias else None, tiling=tiling)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert torch.isfinite(got).all()
    err = (got.double().cpu() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype] * expected.abs().max().item(), f"max error {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_other_rows(dtype, kernel_device, check_dtype):
    """No split over K and one row tile: row i's bits are the same at any batch size up to 16."""
    check_dtype(dtype)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(512, 768, generator=gen).to(kernel_device, dtype)
    x = torch.randn(16, 768, generator=gen).to(kernel_device, dtype)
    full = skinny_linear(x, w)
    for rows in (1, 2, 5, 16):
        assert torch.equal(skinny_linear(x[:rows], w), full[:rows])


def test_every_output_is_written(kernel_device):
    """Outputs come from torch.empty: poison the allocator's memory first, then check every value."""
    w = torch.randn(333, 200, device=kernel_device)
    x = torch.randn(3, 200, device=kernel_device)
    poison = torch.full((3, 333), float("nan"), device=kernel_device)
    del poison  # the caching allocator hands the NaN-filled block to the next allocation of that size
    got = skinny_linear(x, w)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_bad_shapes_name_the_problem(kernel_device):
    w = torch.randn(8, 16, device=kernel_device)
    with pytest.raises(ValueError, match="disagree"):
        skinny_linear(torch.randn(2, 15, device=kernel_device), w)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_linear(torch.randn(17, 16, device=kernel_device), w)


def test_policy_tiles_give_every_multiprocessor_work():
    policy = CUDA_TUNING.skinny
    for n, k in ((4096, 4096), (28672, 4096), (2048, 2048), (128256, 4096), (960, 576)):
        tiling = pick_tiling(n, k, CUDA_TUNING)
        programs = -(-n // tiling.block_n)
        assert policy.min_block_n <= tiling.block_n <= policy.max_block_n
        assert programs >= policy.target_programs or tiling.block_n == policy.min_block_n
        assert tiling.block_k <= max(policy.block_k, 16)


def test_skinny_linear_module_dispatch_and_swap(kernel_device):
    tuning = KernelTuning(skinny_max_rows=4)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32, bias=False)).to(kernel_device)
    x_small, x_large = torch.randn(3, 64, device=kernel_device), torch.randn(9, 64, device=kernel_device)
    expected_small, expected_large = model(x_small), model(x_large)
    weights = [model[0].weight, model[2].weight]
    swapped = use_skinny_linears(model, tuning) if kernel_device == "cuda" else 0
    if kernel_device == "cuda":
        assert swapped == 2 and isinstance(model[0], SkinnyLinear) and isinstance(model[2], SkinnyLinear)
        assert model[0].weight is weights[0] and model[2].weight is weights[1]  # same parameters, not copies
    torch.testing.assert_close(model(x_small), expected_small, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model(x_large), expected_large)
    assert use_skinny_linears(nn.Sequential(nn.Linear(4, 4)), KernelTuning(skinny_max_rows=0)) == 0
