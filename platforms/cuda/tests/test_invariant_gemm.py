"""The batch-invariant GEMM (podium_cuda.invariant_gemm): a row's result is bit for bit the same
alone and inside any batch, and within rounding of a float64 reference, for the default plan and
for every kernel and tiling a plan may pick (gemm_plan.CANDIDATES, the TMA kernel among them).

Under TRITON_INTERPRET=1 (no GPU) float32 and float16 run (the interpreter's bf16 dot is wrong; it
emulates tensor descriptors); on a GPU bf16 too, where cuBLAS's F.linear is the thing being replaced.
The interpreter's tl.dot is numpy's matmul, whose BLAS rounds a row by its place in the tile (its
own blocking, not the kernel's), so there a row alone is compared only at a program's first place,
while batches are compared as prefixes of the full batch (every row at its place); a GPU's MMA
computes a row from that row alone wherever it sits.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cuda_checks import relative_error
from torch import nn

from podium_cuda.gemm_plan import CANDIDATES, GemmPlan, GemmTiling
from podium_cuda.tuning import CUDA_TUNING

pytestmark = pytest.mark.cuda
gemm = pytest.importorskip("podium_cuda.invariant_gemm", reason="the batch-invariant GEMM needs triton")

# (K, N): tails in both (masked loads), then a SmolLM2 / 1B-like shape scaled down
SHAPES = [(96, 40), (200, 130), (576, 192)]
BATCHES = (1, 3, 17, 64, 65, 130, 300)


def _dtypes(kernel_device: str):
    return (torch.float32,) if kernel_device == "cpu" else (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_rows_do_not_depend_on_the_batch(kernel_device, k, n, bias):
    for dtype in _dtypes(kernel_device):
        gen = torch.Generator().manual_seed(k + n)
        weight = (torch.randn(n, k, generator=gen) / k**0.5).to(kernel_device, dtype)
        b = torch.randn(n, generator=gen).to(kernel_device, dtype) if bias else None
        x = torch.randn(max(BATCHES), k, generator=gen).to(kernel_device, dtype)
        full = gemm.invariant_linear(x, weight, b)
        for rows in BATCHES:
            assert torch.equal(gemm.invariant_linear(x[:rows], weight, b), full[:rows]), (dtype, rows)
        # one row alone, at a program's first/last row and the last. The interpreter's tl.dot is
        # numpy's matmul, whose BLAS rounds a row by its place in the tile (its own blocking, not
        # the kernel's), so there only rows at a program's first place compare; a GPU's MMA does not
        block_m = CUDA_TUNING.invariant_gemm.default.block_m
        for i in (0, 63, 64, 299) if kernel_device == "cuda" else (0, block_m, 2 * block_m):
            assert torch.equal(gemm.invariant_linear(x[i:i + 1], weight, b), full[i:i + 1]), (dtype, i)
        want = x.double() @ weight.double().T + (b.double() if bias else 0)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert relative_error(full, want)[0] < tol, dtype


def test_invariant_linear_swaps_every_linear_and_keeps_parameters(kernel_device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32, bias=False)).to(kernel_device)
    x = torch.randn(5, 7, 64, device=kernel_device)
    want = model(x)
    weights = [model[0].weight, model[2].weight]
    assert gemm.use_invariant_linears(model) == 2
    assert isinstance(model[0], gemm.InvariantLinear) and model[0].weight is weights[0]
    assert sorted(dict(model.named_parameters())) == ["0.bias", "0.weight", "2.weight"]
    assert relative_error(model(x), want.double())[0] < 1e-5


def test_mixed_dtypes_are_refused(kernel_device):
    with pytest.raises(ValueError, match="one dtype"):
        gemm.invariant_linear(torch.zeros(2, 8, device=kernel_device),
                              torch.zeros(4, 8, device=kernel_device, dtype=torch.float64))


def _run(tiling: GemmTiling, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=rows.dtype, device=rows.device)
    gemm.linear_with(tiling, rows, weight, bias, out)
    return out


def _candidate_dtypes(kernel_device: str):
    return (torch.float16,) if kernel_device == "cpu" else (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("tiling", CANDIDATES, ids=lambda t: t.text())
def test_every_candidate_tiling_is_batch_invariant_and_accurate(kernel_device, tiling):
    """Each tiling the GPU benchmark may put in a plan, run exactly as listed: K and N tails (200 =
    3 x 64 + 8, 136 = 128 + 8; both whole 16-byte rows, as the TMA kernel needs), a bias on the
    pointer kernel's and the TMA kernel's first candidate, rows 1-300."""
    k, n = 200, 136
    bias = tiling in (CANDIDATES[0], CANDIDATES[3])
    for dtype in _candidate_dtypes(kernel_device):
        if tiling.kernel != "tiles" and not gemm.tma_fits(n, k, dtype, torch.device(kernel_device)):
            pytest.skip("the TMA kernel needs a Hopper GPU (or the interpreter)")
        gen = torch.Generator().manual_seed(7)
        weight = (torch.randn(n, k, generator=gen) / k**0.5).to(kernel_device, dtype)
        b = torch.randn(n, generator=gen).to(kernel_device, dtype) if bias else None
        x = torch.randn(300, k, generator=gen).to(kernel_device, dtype)
        full = _run(tiling, x, weight, b)
        for rows in (1, 65, 130):
            assert torch.equal(_run(tiling, x[:rows], weight, b), full[:rows]), (dtype, rows)
        alone = (tiling.block_m, 299) if kernel_device == "cuda" else (tiling.block_m, 2 * tiling.block_m)
        for i in (i for i in alone if i < 300):
            assert torch.equal(_run(tiling, x[i:i + 1], weight, b), full[i:i + 1]), (dtype, i)
        want = x.double() @ weight.double().T + (b.double() if bias else 0)
        assert relative_error(full, want)[0] < 2e-3, dtype


def test_plan_picks_listed_shapes_and_falls_back_by_shape_alone(kernel_device):
    device = torch.device(kernel_device)
    listed = GemmTiling(64, 128, 64, 4, 4, kernel="tma")
    plan = GemmPlan(GemmTiling(128, 128, 64, 8, 3, kernel="tma"), ((136, 200, listed),))
    half = torch.float16
    if not gemm.tma_fits(136, 200, half, device):
        pytest.skip("the TMA kernel needs a Hopper GPU (or the interpreter)")
    assert gemm.choose_tiling(136, 200, half, device, plan) == listed
    # not listed: the default, narrowed to 64-wide tiles for a weight of few column tiles
    assert gemm.choose_tiling(136, 208, half, device, plan) == GemmTiling(128, 64, 64, 8, 3, kernel="tma")
    # float32: the default's tiles (block_k halved) on the pointer kernel, the table unused
    assert gemm.choose_tiling(136, 200, torch.float32, device, plan) == GemmTiling(128, 64, 32, 8, 3)
    # rows of 2 x 68 bytes are no whole 16-byte units: the pointer kernel with the default's tiles
    assert gemm.choose_tiling(68, 200, half, device, GemmPlan(shapes=((68, 200, listed),))) == \
        GemmTiling(128, 64, 64, 8, 3)
    # the plan is what invariant_linear runs, and an unaligned input gives the same bits
    tuning = replace(CUDA_TUNING, invariant_gemm=plan)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(136, 200, generator=gen).to(kernel_device, half)
    flat = torch.randn(130 * 200 + 1, generator=gen).to(kernel_device, half)
    x = flat[1:].view(130, 200)  # 2 bytes past an aligned start: the descriptor needs a copy
    assert x.data_ptr() % 16
    want = torch.empty(130, 136, dtype=half, device=kernel_device)
    gemm.linear_with(listed, x.clone(), weight, None, want)
    assert torch.equal(gemm.invariant_linear(x, weight, tuning=tuning), want)
