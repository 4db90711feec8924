"""The one-row FP8 GEMV on the warp MMA (``podium_cuda.fp8_mma_gemv``) against a float64 reference: the row
quantized per token by the contract's ``quantize_per_token`` (after the separate fused_ops kernel for a
prologue), times the weight's e4m3 values and scales. N that are not whole tiles of 16, K over one and
several slices, per-tensor and per-channel scales, a bias, each prologue, each warp / unroll / split
setting. The products are exact and summed in float32, so the bound is the sums' and the output's
rounding. The kernel needs an NVIDIA sm89+ GPU (its config rule runs anywhere)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fp8_gemv import DTYPES, _close, _want, _weight  # the same reference and bounds as the CUDA-core GEMV's

from podium_plugin_api.fp8 import FP8


def _tuning(**changes):
    from podium_cuda.tuning import CUDA_TUNING

    return dataclasses.replace(CUDA_TUNING, **({"fp8_gemv_mma": True} | changes))


@pytest.fixture
def sm89():
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None) \
            or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an NVIDIA GPU of compute capability 8.9 or newer")
    return torch.device("cuda")


SETTINGS = {"default": {}, "8-warps-unroll-2": {"fp8_mma_warps": 8, "fp8_mma_unroll": 2},
            "1-warp-unroll-1": {"fp8_mma_warps": 1, "fp8_mma_unroll": 1, "fp8_mma_programs": 64},
            "one-split-prefetch": {"fp8_mma_programs": 0, "fp8_mma_prefetch": True},
            "bulk-prefetch-capped": {"fp8_mma_bulk_prefetch": True, "fp8_mma_maxnreg": 128, "fp8_mma_programs": 8},
            "bulk-prefetch-unroll-1": {"fp8_mma_bulk_prefetch": True, "fp8_mma_unroll": 1}}


@pytest.mark.cuda
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("n,k", [(40, 64), (136, 2048), (100, 320), (16, 4096), (4099, 1536)])
def test_fp8_mma_gemv_plain(setting, dtype, granularity, n, k, sm89):
    from podium_cuda.fp8_gemv import fp8_gemv
    from podium_cuda.split_k import counters

    gen = torch.Generator().manual_seed(n + k)
    weight, scale = _weight(n, k, granularity, gen)
    x = torch.randn(1, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if n % 2 == 0 else None
    out, summed = fp8_gemv(x.to(sm89), weight.to(sm89), scale.to(sm89), None if bias is None else bias.to(sm89),
                           tuning=_tuning(**SETTINGS[setting]))
    assert out.dtype == dtype and out.shape == (1, n) and summed is None
    _close(out, _want(x, weight, scale, bias), dtype, f"{k} -> {n} {granularity} {dtype} {setting}")
    assert int(counters(sm89, 1).abs().sum()) == 0, "a split count was left nonzero"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("n,k", [(72, 640), (4096, 14336)])
def test_fp8_mma_gemv_prologues(dtype, prologue, n, k, sm89):
    from podium_cuda import fused_ops
    from podium_cuda.fp8_gemv import ADD_RMSNORM, RMSNORM, SILU, fp8_gemv

    gen = torch.Generator().manual_seed(n + k)
    weight, scale = _weight(n, k, "channel", gen)
    weight, scale = weight.to(sm89), scale.to(sm89)
    x = torch.randn(1, 2 * k if prologue == "silu_and_mul" else k, generator=gen).to(dtype).to(sm89)
    residual = torch.randn(1, k, generator=gen).to(dtype).to(sm89)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(sm89)
    if prologue == "rms_norm":
        out, summed = fp8_gemv(x, weight, scale, None, RMSNORM, None, g, 1e-6, _tuning())
        separate = fused_ops.rms_norm(x, g, 1e-6)
    elif prologue == "add_rms_norm":
        out, summed = fp8_gemv(x, weight, scale, None, ADD_RMSNORM, residual, g, 1e-5, _tuning())
        separate, want_sum = fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)
        assert torch.equal(summed, want_sum)
    else:
        out, summed = fp8_gemv(x, weight, scale, None, SILU, tuning=_tuning())
        separate = fused_ops.silu_and_mul(x)
    _close(out, _want(separate, weight.cpu(), scale.cpu()), dtype, f"{prologue} {k} -> {n} {dtype}")


@pytest.mark.cuda
def test_fp8_mma_gemv_in_a_graph_replays_new_rows(sm89):
    """Captured once, replayed over new rows: the split counters are back at zero after every launch."""
    from podium_cuda.fp8_gemv import fp8_gemv

    gen = torch.Generator().manual_seed(7)
    weight, scale = _weight(256, 4096, "channel", gen)
    weight, scale = weight.to(sm89), scale.to(sm89)
    x = torch.zeros(1, 4096, dtype=torch.bfloat16, device=sm89)
    tuning = _tuning()
    fp8_gemv(x, weight, scale, tuning=tuning)  # compiled, counters allocated before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = fp8_gemv(x, weight, scale, tuning=tuning)
    for seed in range(3):
        rows = torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        x.copy_(rows)
        graph.replay()
        _close(out, _want(rows, weight.cpu(), scale.cpu()), torch.bfloat16, f"replay {seed}")


@pytest.mark.cuda
def test_fp8_mma_gemv_takes_one_row_whole_steps_only(sm89):
    from podium_cuda import fp8_mma_gemv

    weight, channel = torch.zeros(32, 128, dtype=FP8, device="cuda"), torch.ones(32, 1, device="cuda")
    x = torch.zeros(1, 128, device="cuda")
    assert fp8_mma_gemv.takes(x, weight, channel, _tuning())
    assert not fp8_mma_gemv.takes(x, weight, channel, _tuning(fp8_gemv_mma=False))
    assert not fp8_mma_gemv.takes(torch.zeros(2, 128, device="cuda"), weight, channel, _tuning())
    assert not fp8_mma_gemv.takes(torch.zeros(1, 96, device="cuda"), weight[:, :96].contiguous(), channel,
                                  _tuning())  # K not whole steps of 64: the CUDA-core GEMV
    assert not fp8_mma_gemv.takes(x, weight, torch.ones(1, 1, 1, device="cuda"), _tuning())


def test_fp8_mma_gemv_config_gives_whole_stretches():
    """Every warp of every split gets whole groups of UNROLL steps (the kernel has no K mask), and the
    splits aim at the programs a multiprocessor asked for."""
    from podium_cuda.fp8_mma_gemv import STEP, config

    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (40, 64), (100, 320), (4099, 1536)]:
        for warps, unroll, programs in [(4, 4, 8), (8, 2, 4), (1, 1, 64), (4, 8, 0), (16, 16, 16)]:
            tuning = _tuning(fp8_mma_warps=warps, fp8_mma_unroll=unroll, fp8_mma_programs=programs)
            w, u, s = config(n, k, 132, tuning)
            assert (k // STEP) % (w * u * s) == 0, (n, k, warps, unroll, programs, (w, u, s))
            assert w <= warps and u <= unroll and s >= 1
            if programs == 0:
                assert s == 1
    assert config(4096, 4096, 132, _tuning()) == (4, 4, 1)  # the default: never split (fp8_mma_programs 0)
    assert config(4096, 4096, 132, _tuning(fp8_mma_programs=8)) == (4, 4, 4)  # 256 tiles: 4 splits of 1024 columns
    assert config(28672, 4096, 132, _tuning(fp8_mma_programs=8)) == (4, 4, 1)  # 1792 tiles: enough programs unsplit
    # 224 steps = 14 x 16: 4 or 5 splits would not divide
    assert config(4096, 14336, 132, _tuning(fp8_mma_programs=8)) == (4, 4, 2)
