"""The batch-1 GEMV (podium_cuda.gemv) against float64 references, at the shapes it is tuned for.

Each fused op must equal "the separate fused_ops kernel, then the linear": the prologue rounds
where that kernel rounds, so the only difference left is the order of the fp32 sums.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cuda_checks import relative_error
from torch import nn

from podium_cuda.tuning import CUDA_TUNING
from podium_plugin_api import ops as reference

pytestmark = pytest.mark.cuda
gemv = pytest.importorskip("podium_cuda.gemv", reason="the GEMV kernels need triton")

# (K, N): tails in both (masked loads), the 1B shapes qkv / o / down, one 8B down (K 14336: 7 tiles)
SHAPES = [(96, 40), (320, 100), (2048, 3072), (2048, 2048), (8192, 2048)]
LARGE = [(14336, 4096)]
DTYPES = (torch.float16, torch.bfloat16)


def _linear(k: int, n: int, bias: bool, dtype, device, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias).requires_grad_(False)
    layer.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
    if bias:
        layer.bias.copy_(torch.randn(n, generator=gen))
    return layer.to(device=device, dtype=dtype)


def _float64(module_or_tensor):
    if isinstance(module_or_tensor, nn.Module):
        return copy.deepcopy(module_or_tensor).to(device="cpu", dtype=torch.float64)
    return None if module_or_tensor is None else module_or_tensor.detach().cpu().double()


def _inputs(k: int, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, k, generator=gen).to(dtype).to(device)
    residual = torch.randn(1, k, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(device)
    return x, residual, weight


def _close(got, want, dtype, what):
    err = relative_error(got.float().cpu(), want.float())[1]  # the worst row
    bound = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert err < bound, f"{what}: relative error {err:.3g} (bound {bound})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("with_residual,bias", [(True, False), (False, True)])
def test_rms_norm_linear_one_row(dtype, k, n, with_residual, bias, kernel_device, check_dtype):
    check_dtype(dtype)
    linear = _linear(k, n, bias, dtype, kernel_device, seed=k + n)
    x, residual, weight = _inputs(k, dtype, kernel_device, seed=k)
    residual = residual if with_residual else None
    assert gemv.takes_gemv(x, linear, CUDA_TUNING)
    out, summed = gemv.rms_norm_linear(x, residual, weight, 1e-5, linear)
    want, want_sum = reference.rms_norm_linear(_float64(x), _float64(residual), _float64(weight), 1e-5, _float64(linear))
    _close(out, want, dtype, f"rms_norm_linear K={k} N={n}")
    if with_residual:  # x + residual rounded once, as torch adds: bit-equal
        assert torch.equal(summed, x + residual)
    else:
        assert summed is x
    # the same as the separate kernels and cuBLAS, up to the order of fp32 sums
    sep_out, _ = gemv.rms_norm_linear(x, residual, weight, 1e-5, linear, tuning=_no_gemv())
    _close(out, sep_out.double().cpu(), dtype, f"rms_norm_linear K={k} N={n} against the separate kernels")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_silu_and_mul_linear_one_row(dtype, k, n, bias, kernel_device, check_dtype):
    check_dtype(dtype)
    linear = _linear(k, n, bias, dtype, kernel_device, seed=k * n)
    x = torch.randn(1, 2 * k, generator=torch.Generator().manual_seed(n)).mul(2).to(dtype).to(kernel_device)
    out = gemv.silu_and_mul_linear(x, linear)
    _close(out, reference.silu_and_mul_linear(_float64(x), _float64(linear)), dtype, f"silu_and_mul_linear K={k} N={n}")
    _close(out, gemv.silu_and_mul_linear(x, linear, tuning=_no_gemv()).double().cpu(), dtype, "against separate")


@pytest.mark.parametrize("k,n", LARGE)
def test_long_rows_accumulate_every_tile(k, n, gpu):
    linear = _linear(k, n, False, torch.bfloat16, gpu, seed=3)
    x, residual, weight = _inputs(k, torch.bfloat16, gpu, seed=3)
    out, _ = gemv.rms_norm_linear(x, residual, weight, 1e-5, linear)
    want, _ = reference.rms_norm_linear(_float64(x), _float64(residual), _float64(weight), 1e-5, _float64(linear))
    _close(out, want, torch.bfloat16, f"rms_norm_linear K={k} N={n}")


def test_batch_one_linear_takes_one_row_and_leaves_the_rest_to_cublas(kernel_device, check_dtype):
    dtype = torch.float16
    check_dtype(dtype)
    model = nn.Sequential(_linear(320, 100, True, dtype, kernel_device, 1), nn.ReLU(),
                          _linear(100, 7, False, dtype, kernel_device, 2))
    plain, weight = copy.deepcopy(model), model[0].weight
    assert gemv.use_batch_one_linears(model) == 2
    assert all(type(m) is gemv.BatchOneLinear for m in (model[0], model[2]))
    assert model[0].weight is weight  # the same parameters, converted in place
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(0)).to(dtype).to(kernel_device)
    assert torch.equal(model(x), plain(x))  # 5 rows: F.linear, unchanged
    one = x[:1]
    assert gemv.takes_gemv(one, model[0], CUDA_TUNING)
    _close(model(one), _float64(plain)(_float64(one)), dtype, "one row through two BatchOneLinears")


def test_what_does_not_take_the_gemv(kernel_device):
    linear = _linear(64, 32, False, torch.float16, kernel_device, 0)
    one = torch.randn(1, 64, dtype=torch.float16, device=kernel_device)
    assert gemv.takes_gemv(one, linear, CUDA_TUNING)
    assert not gemv.takes_gemv(one.repeat(2, 1), linear, CUDA_TUNING)  # 2 rows: cuBLAS
    assert not gemv.takes_gemv(one.float(), linear.float(), CUDA_TUNING)  # float32: cuBLAS (exactness tests)
    assert not gemv.takes_gemv(one, linear.bfloat16(), CUDA_TUNING)  # weight of another dtype
    assert not gemv.takes_gemv(one, linear, _no_gemv())

    class Packed(nn.Linear):  # some other platform's transformed linear: called, never read
        pass

    assert not gemv.takes_gemv(one, Packed(64, 32).half(), CUDA_TUNING)


def test_configs_cover_every_multiprocessor():
    assert gemv.gemv_config(3072, 2048, 132) == (4, 2048, 4)  # 1B qkv
    assert gemv.gemv_config(2048, 2048, 132) == (2, 2048, 4)  # 1B o: 1024 programs
    assert gemv.gemv_config(2048, 8192, 132) == (2, 2048, 8)  # 1B down
    assert gemv.gemv_config(128256, 2048, 132) == (4, 2048, 4)  # lm_head
    assert gemv.gemv_config(40, 96, 132) == (2, 128, 4)  # small K: one tile


def test_gemv_replays_in_a_cuda_graph(gpu):
    linear = _linear(2048, 3072, False, torch.bfloat16, gpu, seed=5)
    down = _linear(1024, 2048, False, torch.bfloat16, gpu, seed=6)
    x, residual, weight = _inputs(2048, torch.bfloat16, gpu, seed=5)

    def step():
        qkv, summed = gemv.rms_norm_linear(x, residual, weight, 1e-5, linear)
        return gemv.silu_and_mul_linear(qkv[:, :2048].contiguous(), down), summed

    eager = step()
    # programmatic dependent launches (the default on sm90+) change when kernels start, never results
    no_pdl = (gemv.silu_and_mul_linear(gemv.rms_norm_linear(x, residual, weight, 1e-5, linear, tuning=_no_pdl())[0]
                                       [:, :2048].contiguous(), down, tuning=_no_pdl()))
    assert torch.equal(eager[0], no_pdl)
    graph = torch.cuda.CUDAGraph()
    step()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    again = step()
    assert torch.equal(captured[0], again[0]) and torch.equal(captured[1], again[1])
    assert not torch.equal(eager[0], again[0])  # the replay read the new input


def _tuning(**changes):
    from dataclasses import replace

    return replace(CUDA_TUNING, **changes)


def _no_gemv():
    return _tuning(gemv_batch1=False)


def _no_pdl():
    return _tuning(gemv_pdl=False)
