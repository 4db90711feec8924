"""The CUDA platform's ``rms_norm_linear`` / ``silu_and_mul_linear`` (``podium_cuda.fused_linear``) in front of
quantized layers: a layer that declares its op (``quantized_op`` / ``quantized_args``, the contract a
quantization method's layers follow) gets the norm or SiLU-and-mul inside its kernel where the tuning
sends the call there (the FP8 or INT4 GEMV), and otherwise the separate kernel then the layer; either
way the result equals the composite of the separate fused kernel and the layer, within the format's
rounding. Also the FP8 rows' fused quantization ahead of ``_scaled_mm`` (GPU only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from podium_plugin_api.fp8 import FP8
from podium_plugin_api.int4 import AWQ, random_packed

pytestmark = pytest.mark.cuda


class Fp8Layer(nn.Module):
    """An FP8 layer as the contract describes one, computing with the platform's op."""

    quantized_op = "fp8_linear"

    def __init__(self, n: int, k: int, gen: torch.Generator, device, tuning) -> None:
        super().__init__()
        self.weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8).to(device)
        self.scale = (torch.rand(n, 1, generator=gen) / 1000 + 1e-4).to(device)
        self.tuning = tuning

    def quantized_args(self) -> tuple:
        return self.weight, self.scale, None

    def forward(self, x):
        from podium_cuda.fp8_linear import fp8_linear

        return fp8_linear(x, self.weight, self.scale, None, tuning=self.tuning)


class Int4Layer(nn.Module):
    quantized_op = "int4_linear"

    def __init__(self, n: int, k: int, gen: torch.Generator, device, tuning) -> None:
        super().__init__()
        packed = random_packed(AWQ, k, n, 128, generator=gen)
        self.qweight, self.qzeros, self.scales = (packed[t].to(device) for t in ("qweight", "qzeros", "scales"))
        self.tuning = tuning

    def quantized_args(self) -> tuple:
        return self.qweight, self.qzeros, self.scales, None, 128, AWQ, None

    def forward(self, x):
        from podium_cuda.int4 import int4_linear

        return int4_linear(x, *self.quantized_args(), tuning=self.tuning)


def _relative(a, b) -> float:
    return ((a.double().cpu() - b.double().cpu()).abs().max() / b.double().abs().max().cpu()).item()


def _calls(module, name):
    """Counts the calls of ``module.name`` (the test's spy on which path ran)."""
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    return calls, original, spy


@pytest.mark.parametrize("kind", ["fp8", "int4"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("fused_rows", [0, 4], ids=["separate", "fused"])
def test_norm_and_silu_before_a_quantized_layer(kind, rows, fused_rows, kernel_device, monkeypatch):
    from podium_cuda import fp8_gemv, fused_linear, fused_ops, int4_gemv
    from podium_cuda.tuning import CUDA_TUNING

    tuning = dataclasses.replace(CUDA_TUNING, fp8_gemv_max_rows=fused_rows, int4_gemv_max_rows=fused_rows)
    dev, k, n = kernel_device, 256, 64
    gen = torch.Generator().manual_seed(rows + fused_rows)
    layer = (Fp8Layer if kind == "fp8" else Int4Layer)(n, k, gen, dev, tuning)
    down = (Fp8Layer if kind == "fp8" else Int4Layer)(n, k, gen, dev, tuning)
    kernels = fp8_gemv if kind == "fp8" else int4_gemv
    name = "fp8_gemv" if kind == "fp8" else "int4_gemv"
    calls, original, spy = _calls(kernels, name)
    monkeypatch.setattr(kernels, name, spy)
    x = torch.randn(rows, k, generator=gen).to(dev)
    residual = torch.randn(rows, k, generator=gen).to(dev)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dev)
    gate_up = torch.randn(rows, 2 * k, generator=gen).to(dev)

    out, summed = fused_linear.rms_norm_linear(x, residual, g, 1e-5, layer, tuning=tuning)
    normed, want_sum = fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)
    assert torch.equal(summed, want_sum)
    assert _relative(out, layer(normed)) < 1e-5
    out, same = fused_linear.rms_norm_linear(x, None, g, 1e-6, layer, tuning=tuning)
    assert same is x and _relative(out, layer(fused_ops.rms_norm(x, g, 1e-6))) < 1e-5
    out = fused_linear.silu_and_mul_linear(gate_up, down, tuning=tuning)
    assert _relative(out, down(fused_ops.silu_and_mul(gate_up))) < 1e-5
    # the layer's own calls above went through the GEMV too where it takes their rows: 3 fused + 3 plain
    assert len(calls) == (6 if rows <= fused_rows else 0)


def test_a_plain_linear_keeps_the_bf16_path(kernel_device):
    """No quantized_op: the call goes where it went before (gemv.py: the separate kernels for float32)."""
    from podium_cuda import fused_linear, fused_ops

    linear = nn.Linear(64, 32, bias=False).to(kernel_device)
    x, g = torch.randn(2, 64, device=kernel_device), torch.ones(64, device=kernel_device)
    out, same = fused_linear.rms_norm_linear(x, None, g, 1e-6, linear)
    assert same is x
    torch.testing.assert_close(out, linear(fused_ops.rms_norm(x, g, 1e-6)))


@pytest.mark.parametrize("rows", [5, 64])
@pytest.mark.parametrize("prologue", ["add_rms_norm", "silu_and_mul"])
def test_fp8_quantization_fused_ahead_of_scaled_mm(rows, prologue, gpu):
    """bf16 rows past the GEMV's threshold: one Triton launch quantizes the norm's / SiLU's output for
    _scaled_mm; the result equals the separate kernel, the contract's quantization and _scaled_mm."""
    from podium_cuda import fp8_quant, fused_linear, fused_ops
    from podium_cuda.fp8_linear import scaled_mm_linear
    from podium_cuda.tuning import CUDA_TUNING

    tuning = dataclasses.replace(CUDA_TUNING, fp8_gemv_max_rows=0)
    gen = torch.Generator().manual_seed(rows)
    k, n = 512, 256
    layer = Fp8Layer(n, k, gen, gpu, tuning)
    calls, original, spy = _calls(fp8_quant, "quantize")
    fp8_quant.quantize = spy
    try:
        if prologue == "add_rms_norm":
            x = torch.randn(rows, k, generator=gen).to(gpu, torch.bfloat16)
            residual = torch.randn(rows, k, generator=gen).to(gpu, torch.bfloat16)
            g = torch.ones(k, device=gpu, dtype=torch.bfloat16)
            out, summed = fused_linear.rms_norm_linear(x, residual, g, 1e-5, layer, tuning=tuning)
            separate, want_sum = fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)
            assert torch.equal(summed, want_sum)
        else:
            x = torch.randn(rows, 2 * k, generator=gen).to(gpu, torch.bfloat16)
            out = fused_linear.silu_and_mul_linear(x, layer, tuning=tuning)
            separate = fused_ops.silu_and_mul(x)
    finally:
        fp8_quant.quantize = original
    assert calls, "the fused quantization did not run"
    want = scaled_mm_linear(separate, layer.weight, layer.scale, fused_quant=False)
    assert _relative(out, want) < 1e-2
