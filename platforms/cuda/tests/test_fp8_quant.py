"""FP8 activation quantization in one launch (``podium_cuda.fp8_quant``) against the contract's
``quantize_per_token`` applied to what the separate kernel before it writes (fused_ops' RMSNorm,
add-RMSNorm, SiLU-and-mul, or x itself): the same e4m3 bytes and the same float32 scales, bit for bit,
at 1..16 rows and row widths that are not whole chunks (and wider than one chunk). After a norm the
GPU may sum the squares in another order than fused_ops' one-block kernel (a last-bit rstd), so there
a value may sit one e4m3 step away at a rounding boundary. Under ``TRITON_INTERPRET=1`` float32 and
float16 rows; on the GPU bf16 too."""

from __future__ import annotations

import pytest
import torch

from podium_plugin_api.fp8 import quantize_per_token

pytestmark = pytest.mark.cuda
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def _assert_same(got, want, what, steps: int = 0):
    """The same bytes; with ``steps``, a few values may sit one e4m3 step away (a rounding boundary
    crossed by a last-bit difference upstream), and the scales within a bf16 rounding."""
    q, s = got[0], got[1]
    want_q, want_s = want
    differ = _bits(q) != _bits(want_q)
    if not steps:
        assert int(differ.sum()) == 0, f"{what}: {int(differ.sum())} e4m3 values differ from quantize_per_token's"
        assert torch.equal(s.cpu(), want_s.cpu()), f"{what}: row scales differ"
        return
    assert int(differ.sum()) <= max(2, q.numel() // 1000), f"{what}: {int(differ.sum())} e4m3 values differ"
    apart = (q.view(torch.int8).cpu().int() - want_q.view(torch.int8).cpu().int()).abs()
    assert int(apart.max()) <= steps, f"{what}: a value {int(apart.max())} e4m3 steps away"
    torch.testing.assert_close(s.cpu(), want_s.cpu(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,k", [(1, 96), (3, 4096), (16, 100), (2, 5000)])
def test_quantize_rows_as_the_contract(dtype, rows, k, kernel_device, check_dtype):
    check_dtype(dtype)
    from podium_cuda.fp8_quant import quantize_per_token as one_launch

    gen = torch.Generator().manual_seed(rows * k)
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    x[0, 3] = 1e-4  # rounds to an e4m3 subnormal
    if rows > 1:
        x[1] = 0  # an all-zero row: scale 1
    got = one_launch(x.to(kernel_device))
    assert got[0].dtype == torch.float8_e4m3fn and got[1].shape == (rows, 1)
    _assert_same(got, quantize_per_token(x), f"{rows} x {k} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("rows,k", [(1, 320), (5, 4100)])
def test_quantize_with_prologue_as_separate_kernel_then_contract(dtype, prologue, rows, k, kernel_device,
                                                                  check_dtype):
    check_dtype(dtype)
    from podium_cuda import fused_ops
    from podium_cuda.fp8_quant import ADD_RMSNORM, RMSNORM, SILU, quantize

    gen = torch.Generator().manual_seed(rows + k)
    dev = kernel_device
    width = 2 * k if prologue == "silu_and_mul" else k
    x = torch.randn(rows, width, generator=gen).to(dtype).to(dev)
    residual = torch.randn(rows, k, generator=gen).to(dtype).to(dev)
    weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(dev)
    if prologue == "rms_norm":
        got = quantize(x, RMSNORM, None, weight, 1e-6)
        separate = fused_ops.rms_norm(x, weight, 1e-6)
    elif prologue == "add_rms_norm":
        got = quantize(x, ADD_RMSNORM, residual, weight, 1e-5)
        separate, summed = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(got[2], summed), "x + residual differs from fused_add_rms_norm's"
    else:
        got = quantize(x, SILU)
        separate = fused_ops.silu_and_mul(x)
    _assert_same(got, quantize_per_token(separate), f"{prologue} {rows} x {k} {dtype}",
                 steps=0 if prologue == "silu_and_mul" or dev == "cpu" else 1)


def test_quantize_refuses_mismatched_norm_inputs(kernel_device):
    from podium_cuda.fp8_quant import ADD_RMSNORM, RMSNORM, quantize

    x = torch.randn(2, 64, device=kernel_device)
    with pytest.raises(ValueError, match="residual"):
        quantize(x, ADD_RMSNORM, torch.randn(3, 64, device=kernel_device), torch.ones(64, device=kernel_device))
    with pytest.raises(ValueError, match="weight"):
        quantize(x, RMSNORM, None, torch.ones(32, device=kernel_device))
