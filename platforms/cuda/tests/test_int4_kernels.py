"""The Triton INT4 kernels (``podium_cuda.int4``) against the contract's dequantization in float64:
AWQ, GPTQ and GPTQ with act-order (a permuted ``g_idx``), one row (the split-K GEMV) and five (the
GEMM, K split), with and without a bias; AWQ_MMA (AWQ converted to the MMA layout) through the GEMM at
every column tile width and row tile, K split and not. Under ``TRITON_INTERPRET=1`` (no GPU) float32 only; on the GPU bf16
too (the GEMM rounds the tile to bf16)."""

from __future__ import annotations

import pytest
import torch

from podium_plugin_api.int4 import AWQ, AWQ_MMA, GPTQ, awq_to_mma, dequantize, random_packed

pytestmark = pytest.mark.cuda
CASES = [(AWQ, False), (GPTQ, False), (GPTQ, True)]


@pytest.mark.parametrize("fmt,act_order", CASES, ids=["awq", "gptq", "gptq-act-order"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_kernel(fmt, act_order, rows, dtype, kernel_device, check_dtype):
    check_dtype(dtype)
    from podium_cuda.int4 import int4_linear

    gen = torch.Generator().manual_seed(rows + 10 * act_order)
    packed = random_packed(fmt, 256, 128, 128, act_order, gen)  # two groups; 2 GEMV column blocks, K split in 2
    x = torch.randn(rows, 256, generator=gen)
    bias = torch.randn(128, generator=gen) if rows == 5 else None
    g_idx = packed.get("g_idx")
    want = x.double() @ dequantize(packed["qweight"], packed["qzeros"], packed["scales"], g_idx, 128, fmt).double()
    if bias is not None:
        want = want + bias.double()
    on = {name: t.to(kernel_device) for name, t in packed.items()}
    got = int4_linear(x.to(kernel_device, dtype), on["qweight"], on["qzeros"], on["scales"], on.get("g_idx"), 128,
                      fmt, None if bias is None else bias.to(kernel_device, dtype))
    assert got.dtype == dtype and got.shape == (rows, 128)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (got.double().cpu() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("n", [256, 64, 96, 48])  # column tiles of 128, 64, 32, 16
@pytest.mark.parametrize("rows", [2, 40, 130])  # row tiles of 16, 64
@pytest.mark.parametrize("split", [True, False], ids=["k-split", "whole-k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_int4_gemm_reads_the_mma_layout(n, rows, split, dtype, kernel_device, check_dtype, monkeypatch):
    """int4.py's GEMM over AWQ_MMA: the tile's columns come out in the words' order, and the scales, zeros,
    bias and output follow it (a wrong column order is off by whole weights); K split over programs where the tiles
    alone are too few (up to 16 rows: these shapes always are, unless the target is lowered) or not."""
    check_dtype(dtype)
    from podium_cuda import int4
    from podium_cuda.int4 import int4_linear

    if not split:
        monkeypatch.setattr(int4, "TARGET_PROGRAMS", 1)

    gen = torch.Generator().manual_seed(n + rows)
    packed = random_packed(AWQ, 512, n, 128, False, gen)
    x = torch.randn(rows, 512, generator=gen)
    bias = torch.randn(n, generator=gen)
    want = x.double() @ dequantize(packed["qweight"], packed["qzeros"], packed["scales"], None, 128, AWQ).double()
    want = want + bias.double()
    on = {name: t.to(kernel_device) for name, t in packed.items()}
    got = int4_linear(x.to(kernel_device, dtype), awq_to_mma(on["qweight"]), on["qzeros"], on["scales"], None, 128,
                      AWQ_MMA, bias.to(kernel_device, dtype))
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double().cpu() - want).abs().max().item() <= tol * want.abs().max().item()
