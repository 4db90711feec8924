"""The batch-invariant GEMM (podium_cuda.invariant_gemm): a row's result is bit for bit the same
alone and inside any batch, and within rounding of a float64 reference.

Under TRITON_INTERPRET=1 (no GPU) only float32 runs (the interpreter's bf16 dot is wrong); on a GPU
bf16 and fp16 too, where cuBLAS's F.linear is the thing being replaced.
"""

from __future__ import annotations

import pytest
import torch
from cuda_checks import relative_error
from torch import nn

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
        block_m = CUDA_TUNING.invariant_gemm.block_m
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
