"""The Triton INT4 kernels (``podium_cuda.int4``) against the contract's dequantization in float64:
AWQ, GPTQ and GPTQ with act-order (a permuted ``g_idx``), one row (the split-K GEMV) and five (the
GEMM), with and without a bias. Under ``TRITON_INTERPRET=1`` (no GPU) float32 only; on the GPU bf16
too (the GEMM rounds the tile to bf16)."""

from __future__ import annotations

import pytest
import torch

from podium_plugin_api.int4 import AWQ, GPTQ, dequantize, random_packed

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
