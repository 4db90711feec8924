"""FP8 W8A8 on CUDA (``podium_cuda.fp8_linear``, ``fp8_gemm``) against a float64 reference written here:
the activations quantized per token to e4m3 (``s = max|x| / 448``, to nearest even), times the
weight's e4m3 values and scales, per tensor, per channel and per 128 x 128 block. The Triton GEMM at
1 and 37 rows (its narrow and wide tiles), with and without a bias; on the GPU also ``_scaled_mm``
and the per-call choice between them. Under ``TRITON_INTERPRET=1`` float32 rows (the kernel then
multiplies the same e4m3 values in float32); on the GPU bf16 rows and the fp8 tensor cores."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
FP8 = torch.float8_e4m3fn


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> its per-token e4m3 approximation q * s, float64."""
    amax = x.float().abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return (x.float() / s).clamp(-448, 448).to(FP8).double() * s.double()


def weight_values(weight: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """The scaled weight [N, K], float64."""
    if granularity == "block":
        return weight.double() * scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return weight.double() * scale.double()


def case(granularity: str, rows: int, dtype: torch.dtype, gen: torch.Generator):
    """x [rows, 384] in dtype, an e4m3 weight [256, 384] (three 128 steps of K, two block rows), its
    scale of ``granularity``, and x . w^T from the reference's quantized rows."""
    n, k = 256, 384
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8)
    shape = {"tensor": (1,), "channel": (n, 1), "block": (n // 128, k // 128)}[granularity]
    scale = torch.rand(shape, generator=gen) / 1000 + 1e-4
    x = torch.randn(rows, k, generator=gen)
    # row 0's amax 2.625 = 21/8: 448 x / amax = 512 x / 3 lands exactly on e4m3 ties for many bf16 x, which a
    # scale or quotient a last bit off (a reciprocal's product, not IEEE division) rounds one way
    x[0] = x[0].clamp(-2.5, 2.5)
    x[0, 9] = 2.625
    x[0, 5] = 0.0001  # a value that rounds to an e4m3 subnormal
    x = x.to(dtype)
    return x, weight, scale, quantized_rows(x) @ weight_values(weight, scale, granularity).t()


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_triton_fp8_gemm(granularity, rows, dtype, kernel_device, check_dtype):
    check_dtype(dtype)
    from podium_cuda import fp8_gemm

    gen = torch.Generator().manual_seed(rows)
    x, weight, scale, want = case(granularity, rows, dtype, gen)
    bias = torch.randn(256, generator=gen).to(dtype) if rows == 37 else None
    if bias is not None:
        want = want + bias.double()
    got = fp8_gemm.fp8_gemm(x.to(kernel_device), weight.to(kernel_device), scale.to(kernel_device),
                            None if bias is None else bias.to(kernel_device), fp8_dot=kernel_device != "cpu")
    assert got.dtype == dtype and got.shape == (rows, 256)
    # bf16: the result's one rounding. float32 on the GPU's fp8 tensor cores: sm90's fp8 MMA (wgmma, the
    # 37-row tiles) keeps ~14 bits of its running sum inside each 128-wide K step (Triton leaves
    # max_num_imprecise_acc unbounded there), 4-8e-4 of the output's max on an H200; the interpreter's
    # float32 products are exact, so 1e-5 there
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3 if kernel_device != "cpu" else 1e-5
    assert (got.double().cpu() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("rows", [1, 37])
def test_fp8_linear_on_either_path(granularity, rows, gpu):
    """bf16 rows through the op the platform installs, with the FP8 GEMV, the Triton GEMM and _scaled_mm
    (its rows quantized by the Triton launch and by the contract's torch function) chosen."""
    import dataclasses

    from podium_cuda.fp8_linear import choice, fp8_linear
    from podium_cuda.tuning import CUDA_TUNING

    x, weight, scale, want = case(granularity, rows, torch.bfloat16, torch.Generator().manual_seed(rows))
    x, weight, scale = x.to(gpu), weight.to(gpu), scale.to(gpu)
    for gemv_rows, max_rows, fused, fast in ((0, 0, True, False), (0, 0, False, False), (0, 0, True, True),
                                             (0, 4096, True, False), (64, 0, True, False)):
        tuning = dataclasses.replace(CUDA_TUNING, fp8_gemv_max_rows=gemv_rows, fp8_triton_max_rows=max_rows,
                                     fp8_fused_quant=fused, fp8_fast_accum=fast)
        if granularity != "block" and rows <= min(gemv_rows, 16):  # fp8_gemv.MAX_ROWS
            expected = "gemv"
        else:
            expected = "triton" if granularity == "block" or max_rows else "scaled_mm"
        assert choice(x, weight, scale, tuning) == expected
        got = fp8_linear(x, weight, scale, tuning=tuning)
        assert (got.double().cpu() - want).abs().max().item() <= 1e-2 * want.abs().max().item(), expected
