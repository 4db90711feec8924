"""The INT4 GEMVs (``podium_cuda.int4_gemv``; one AWQ row: ``podium_cuda.awq_gemv``) against the contract's
dequantization in float64, after the separate fused_ops kernel for a prologue: AWQ and GPTQ (in order),
1..16 rows, N not a whole column block, K split over several programs (and over one), group sizes 32 to
128, a bias, each prologue; the split counters are zero again after every launch. Under
``TRITON_INTERPRET=1`` float32 and float16 rows; on the GPU bf16 too."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from podium_plugin_api.int4 import AWQ, GPTQ, dequantize, random_packed

pytestmark = pytest.mark.cuda
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tuning(block_n: int = 0, splits: int = 0, packed: bool = False):
    from podium_cuda.tuning import CUDA_TUNING

    return dataclasses.replace(CUDA_TUNING, int4_gemv_block_n=block_n, int4_gemv_split_k=splits,
                               int4_gemv_packed=packed)


def _close(got, want, dtype, what):
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
    assert err <= bound, f"{what}: relative max error {err:.2e} (bound {bound:.0e})"


def _counts_zero(device):
    from podium_cuda.split_k import counters

    assert int(counters(torch.device(device), 1).abs().sum()) == 0, "a split count was left nonzero"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", [AWQ, GPTQ])
@pytest.mark.parametrize("rows,k,n,group,block_n,splits", [
    (1, 512, 200, 128, 64, 3),   # N not whole blocks, groups split unevenly
    (1, 384, 256, 128, 256, 0),  # the rule's split
    (1, 256, 64, 64, 64, 1),     # one split: the partial row copied
    (1, 512, 128, 32, 128, 4),
    (3, 384, 200, 128, 64, 3),
    (16, 256, 72, 128, 64, 0),
])
def test_int4_gemv_plain(dtype, fmt, rows, k, n, group, block_n, splits, kernel_device, check_dtype):
    check_dtype(dtype)
    from podium_cuda.int4_gemv import int4_gemv

    gen = torch.Generator().manual_seed(rows * k + n)
    packed = random_packed(fmt, k, n, group, False, gen)
    w = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], packed.get("g_idx"), group, fmt).double()
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    dev = kernel_device
    out, summed = int4_gemv(x.to(dev), packed["qweight"].to(dev), packed["qzeros"].to(dev), packed["scales"].to(dev),
                            group, fmt, bias.to(dev), tuning=_tuning(block_n, splits))
    assert out.dtype == dtype and out.shape == (rows, n) and summed is None
    _close(out, x.double() @ w + bias.double(), dtype, f"{fmt} {rows} x {k} -> {n} g{group}")
    _counts_zero(dev)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", [AWQ, GPTQ])
@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("rows", [1, 4])
def test_int4_gemv_prologues(dtype, fmt, prologue, rows, kernel_device, check_dtype):
    check_dtype(dtype)
    from podium_cuda import fused_ops
    from podium_cuda.int4_gemv import ADD_RMSNORM, RMSNORM, SILU, int4_gemv

    k, n, group = 384, 136, 128
    gen = torch.Generator().manual_seed(rows + len(prologue))
    dev = kernel_device
    packed = random_packed(fmt, k, n, group, False, gen)
    w = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], packed.get("g_idx"), group, fmt).double()
    on = {name: t.to(dev) for name, t in packed.items()}
    x = torch.randn(rows, 2 * k if prologue == "silu_and_mul" else k, generator=gen).to(dtype).to(dev)
    residual = torch.randn(rows, k, generator=gen).to(dtype).to(dev)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(dev)
    args = (on["qweight"], on["qzeros"], on["scales"], group, fmt, None)
    tuning = _tuning(64, 2)
    if prologue == "rms_norm":
        out, _ = int4_gemv(x, *args, RMSNORM, None, g, 1e-6, tuning)
        separate = fused_ops.rms_norm(x, g, 1e-6)
    elif prologue == "add_rms_norm":
        out, summed = int4_gemv(x, *args, ADD_RMSNORM, residual, g, 1e-5, tuning)
        separate, want_sum = fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)
        assert torch.equal(summed, want_sum)
    else:
        out, _ = int4_gemv(x, *args, SILU, tuning=tuning)
        separate = fused_ops.silu_and_mul(x)
    _close(out, separate.double().cpu() @ w, dtype, f"{fmt} {prologue} {rows} rows")
    _counts_zero(dev)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prologue", ["plain", "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 20.0])  # (SiLU-and-mul of 20s and its product: within f16)
@pytest.mark.parametrize("k,n,group,block_n,splits", [
    (512, 200, 128, 64, 3),   # N not whole blocks, groups split unevenly
    (384, 256, 128, 256, 0),  # the rule's split
    (256, 64, 64, 64, 1),     # one split
    (512, 128, 256, 128, 2),  # 32 rows a group a thread: x scaled to 2^3
])
def test_awq_gemv_packed(dtype, prologue, magnitude, k, n, group, block_n, splits, kernel_device, check_dtype):
    """The one-row AWQ GEMV in packed half precision (``int4_gemv_packed``; the interpreter runs its float32
    model of the PTX): x of any magnitude is scaled by a power of two so that the f16 group sums neither
    overflow nor lose their low bits. Only the group sums (8 to 32 terms) round to f16 (11 bits): bound 5e-3
    of the max for float32 and float16 rows, bf16's 1e-2 for bf16."""
    check_dtype(dtype)
    from podium_cuda import fused_ops
    from podium_cuda.int4_gemv import ADD_RMSNORM, PLAIN, SILU, int4_gemv

    gen = torch.Generator().manual_seed(k + n + group)
    dev = kernel_device
    packed = random_packed(AWQ, k, n, group, False, gen)
    w = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], None, group, AWQ).double()
    on = {name: t.to(dev) for name, t in packed.items()}
    width = 2 * k if prologue == "silu_and_mul" else k
    x = (torch.randn(1, width, generator=gen) * magnitude).to(dtype).to(dev)
    residual = (torch.randn(1, k, generator=gen) * magnitude).to(dtype).to(dev)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(dev)
    bias = torch.randn(n, generator=gen).to(dtype).to(dev) * magnitude
    code = {"plain": PLAIN, "add_rms_norm": ADD_RMSNORM, "silu_and_mul": SILU}[prologue]
    out, summed = int4_gemv(x, on["qweight"], on["qzeros"], on["scales"], group, AWQ, bias, code, residual, g,
                            1e-5, _tuning(block_n, splits, packed=True))
    if prologue == "add_rms_norm":
        separate, want_sum = fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)
        assert torch.equal(summed, want_sum)
    else:
        separate = fused_ops.silu_and_mul(x) if prologue == "silu_and_mul" else x
    want = separate.double().cpu() @ w + bias.double().cpu()
    err = ((out.double().cpu() - want).abs().max() / want.abs().max()).item()
    bound = 1e-2 if dtype == torch.bfloat16 else 5e-3
    assert err <= bound, f"packed {prologue} {k} -> {n} g{group} {dtype}: relative max error {err:.2e} (bound {bound})"
    _counts_zero(dev)


def test_int4_gemv_takes(kernel_device):
    from podium_cuda.int4_gemv import MAX_ROWS, takes

    x = torch.zeros(2, 256, device=kernel_device)
    assert takes(x, 64, 256, 128, AWQ, True, 2)
    assert not takes(x, 64, 256, 128, AWQ, True, 1)  # more rows than the tuning's threshold
    assert not takes(x, 64, 256, 128, GPTQ, False, 16)  # act-order
    assert not takes(x, 64, 256, 100, AWQ, True, 16)  # groups not whole 32-row tiles
    assert not takes(torch.zeros(MAX_ROWS + 1, 256, device=kernel_device), 64, 256, 128, AWQ, True, 64)
