"""The FP8 GEMV (``podium_cuda.fp8_gemv``) against a float64 reference: the rows quantized per token by the
contract's ``quantize_per_token`` (after the separate fused_ops kernel for a prologue), times the weight's
e4m3 values and scales. 1..16 rows, N and K that are not whole tiles or slices, per-tensor and
per-channel scales, a bias, each prologue; the products are exact, so the bound is the float32 sums'
and the output's rounding. Under ``TRITON_INTERPRET=1`` float32 and float16 rows; on the GPU bf16 too."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from podium_plugin_api.fp8 import FP8, quantize_per_token

pytestmark = pytest.mark.cuda
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _weight(n: int, k: int, granularity: str, gen: torch.Generator):
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8)
    scale = torch.rand((1,) if granularity == "tensor" else (n, 1), generator=gen) / 1000 + 1e-4
    return weight, scale


def _want(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias=None) -> torch.Tensor:
    q, s = quantize_per_token(rows.cpu())
    out = (q.double() @ weight.double().t()) * s.double() * scale.double().reshape(1, -1)
    return out if bias is None else out + bias.double().cpu()


def _close(got, want, dtype, what):
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
    assert err <= bound, f"{what}: relative max error {err:.2e} (bound {bound:.0e})"


def _tuning(dot: bool, block_k: int = 0, **changes):
    from podium_cuda.tuning import CUDA_TUNING

    # the CUDA-core / tensor-core GEMV: the warp MMA (the default at one row, test_fp8_mma_gemv.py) off
    return dataclasses.replace(CUDA_TUNING, fp8_gemv_dot=dot, fp8_gemv_block_k=block_k,
                               **({"fp8_gemv_mma": False} | changes))


@pytest.mark.parametrize("dot", [True, False], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("rows,n,k", [(1, 40, 96), (1, 136, 2048), (3, 100, 320), (16, 24, 1100)])
def test_fp8_gemv_plain(dot, dtype, granularity, rows, n, k, kernel_device, check_dtype):
    check_dtype(dtype)
    from podium_cuda.fp8_gemv import fp8_gemv

    gen = torch.Generator().manual_seed(rows * n + k)
    weight, scale = _weight(n, k, granularity, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if rows != 16 else None
    dev = kernel_device
    out, summed = fp8_gemv(x.to(dev), weight.to(dev), scale.to(dev), None if bias is None else bias.to(dev),
                           tuning=_tuning(dot))
    assert out.dtype == dtype and out.shape == (rows, n) and summed is None
    _close(out, _want(x, weight, scale, bias), dtype, f"{rows} x {k} -> {n} {granularity} {dtype}")


@pytest.mark.parametrize("dot", [True, False], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("rows,n,k", [(1, 72, 640), (5, 40, 300)])
def test_fp8_gemv_prologues(dot, dtype, prologue, rows, n, k, kernel_device, check_dtype):
    check_dtype(dtype)
    from podium_cuda import fused_ops
    from podium_cuda.fp8_gemv import ADD_RMSNORM, RMSNORM, SILU, fp8_gemv

    gen = torch.Generator().manual_seed(n + k)
    dev = kernel_device
    weight, scale = _weight(n, k, "channel", gen)
    weight, scale = weight.to(dev), scale.to(dev)
    x = torch.randn(rows, 2 * k if prologue == "silu_and_mul" else k, generator=gen).to(dtype).to(dev)
    residual = torch.randn(rows, k, generator=gen).to(dtype).to(dev)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(dev)
    if prologue == "rms_norm":
        out, summed = fp8_gemv(x, weight, scale, None, RMSNORM, None, g, 1e-6, _tuning(dot))
        separate = fused_ops.rms_norm(x, g, 1e-6)
    elif prologue == "add_rms_norm":
        out, summed = fp8_gemv(x, weight, scale, None, ADD_RMSNORM, residual, g, 1e-5, _tuning(dot))
        separate, want_sum = fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)
        assert torch.equal(summed, want_sum)
    else:
        out, summed = fp8_gemv(x, weight, scale, None, SILU, tuning=_tuning(dot))
        separate = fused_ops.silu_and_mul(x)
    _close(out, _want(separate, weight.cpu(), scale.cpu()), dtype, f"{prologue} {rows} x {k} -> {n} {dtype}")


@pytest.mark.parametrize("dot", [True, False], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("block_k", [64, 128])
def test_fp8_gemv_slices_of_k(dot, block_k, kernel_device):
    """The tuning's fp8_gemv_block_k replaces the rule's slice width: K over several slices (one not
    whole), the partial sums added by the last program of each feature range."""
    from podium_cuda.fp8_gemv import config, fp8_gemv
    from podium_cuda.split_k import counters

    tuning = _tuning(dot, block_k)
    assert config(1, 4096, 4096, 132, tuning)[0] == block_k
    gen = torch.Generator().manual_seed(block_k)
    weight, scale = _weight(48, 300, "channel", gen)
    for rows in (1, 2):  # (N 48: the range's last tile part masked)
        x = torch.randn(rows, 300, generator=gen)
        out, _ = fp8_gemv(x.to(kernel_device), weight.to(kernel_device), scale.to(kernel_device), tuning=tuning)
        _close(out, _want(x, weight, scale), torch.float32, f"block_k {block_k}, {rows} rows")
    assert int(counters(torch.device(kernel_device), 1).abs().sum()) == 0, "a split count was left nonzero"


def test_fp8_gemv_takes_few_rows_and_row_scales_only():
    from podium_cuda.fp8_gemv import MAX_ROWS, takes

    weight = torch.zeros(32, 64, dtype=FP8)
    channel, block = torch.ones(32, 1), torch.ones(1, 1, 2)
    x = torch.zeros(4, 64, device="cuda" if torch.cuda.is_available() else "cpu")
    if x.device.type == "cpu":
        pytest.importorskip("triton")
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs the GPU or Triton's interpreter")
    weight, channel = weight.to(x.device), channel.to(x.device)
    assert takes(x, weight, channel, 4)
    assert not takes(x, weight, channel, 3)
    assert not takes(x, weight, block.to(x.device), 16)
    assert not takes(torch.zeros(MAX_ROWS + 1, 64, device=x.device), weight, channel, 64)


ONE_ROW = {"packed": {"fp8_gemv_packed": True}, "quantize-first": {"fp8_gemv_quantize_first": True},
           "packed-quantize-first": {"fp8_gemv_packed": True, "fp8_gemv_quantize_first": True},
           "packed-one-program": {"fp8_gemv_packed": True, "fp8_gemv_programs": 1},
           "packed-bits": {"fp8_gemv_packed": True, "fp8_gemv_bits": True},
           "packed-bits-quantize-first": {"fp8_gemv_packed": True, "fp8_gemv_bits": True,
                                          "fp8_gemv_quantize_first": True}}


@pytest.mark.parametrize("variant", list(ONE_ROW))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prologue", ["plain", "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("n,k,block_k", [(40, 96, 0), (136, 2048, 0), (72, 1536, 0), (52, 1100, 512)])
def test_fp8_gemv_one_row_variants(variant, dtype, prologue, n, k, block_k, kernel_device, check_dtype):
    """The one-row variants the tuning selects: packed half-precision products (K a whole slice, several
    slices, a slice partly past K), the row quantized first by fp8_quant's launch, both. Packed sums
    round 16 products at a time to f16 (11 bits): bound 2e-3 of the max for float32 rows too."""
    check_dtype(dtype)
    from podium_cuda import fused_ops
    from podium_cuda.fp8_gemv import ADD_RMSNORM, PLAIN, SILU, fp8_gemv

    gen = torch.Generator().manual_seed(n + k)
    dev = kernel_device
    weight, scale = _weight(n, k, "channel", gen)
    x = torch.randn(1, 2 * k if prologue == "silu_and_mul" else k, generator=gen).to(dtype).to(dev)
    residual = torch.randn(1, k, generator=gen).to(dtype).to(dev)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(dev)
    tuning = _tuning(False, block_k, **ONE_ROW[variant])
    code = {"plain": PLAIN, "add_rms_norm": ADD_RMSNORM, "silu_and_mul": SILU}[prologue]
    out, summed = fp8_gemv(x, weight.to(dev), scale.to(dev), None, code, residual, g, 1e-5, tuning)
    if prologue == "add_rms_norm":
        separate, want_sum = fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)
        assert torch.equal(summed, want_sum)
    else:
        separate = fused_ops.silu_and_mul(x) if prologue == "silu_and_mul" else x
    want = _want(separate, weight, scale)
    coarser = dtype if dtype == torch.bfloat16 or "packed" not in variant else torch.float16
    _close(out, want, coarser, f"{variant} {prologue} {k} -> {n} {dtype}")


def test_fp8_gemv_packed_slices():
    """The packed steps' slices are whole multiples of 512 dividing K where one does (no column masks)."""
    from podium_cuda.fp8_gemv import bits, config

    tuning = _tuning(False, fp8_gemv_packed=True)
    assert config(1, 28672, 4096, 132, tuning)[:2] == (4096, 4)
    assert config(1, 4096, 14336, 132, tuning)[0] == 2048
    assert config(1, 40, 96, 132, tuning)[0] == 512
    assert config(2, 40, 4096, 132, tuning)[0] == 512  # two rows: the plain CUDA-core steps
    assert config(1, 40, 4096, 132, _tuning(True, fp8_gemv_packed=True))[1] == 128  # tensor cores win
    assert config(1, 28672, 4096, 132, tuning)[2] == 56  # 4 x 132 feature ranges of whole 4-row steps
    with_bits = _tuning(False, fp8_gemv_packed=True, fp8_gemv_bits=True)
    assert bits(1, 14336, 2048, with_bits) and bits(1, 1536, 512, with_bits)
    assert not bits(1, 1100, 512, with_bits)  # a slice past K: the conversion unit's steps, masked
    assert not bits(1, 4096, 4096, tuning) and not bits(2, 4096, 512, with_bits)
    assert config(1, 28672, 4096, 132, _tuning(False, fp8_gemv_packed=True, fp8_gemv_programs=2))[2] == 112
