"""The fused ops ``rms_norm_linear`` and ``silu_and_mul_linear`` (``podium_plugin_api.ops``) on CUDA.

The projection after the norm or SiLU-and-mul decides the kernel:

- a quantized layer (``podium_plugin_api.quantization.quantized_call``): FP8 (fp8_linear.py: the FP8
  GEMV at a few rows, else the rows' quantization with the elementwise op inside it, then
  ``_scaled_mm``) and INT4 (int4.py: the INT4 GEMV at a few rows), each computing the elementwise
  op in its own kernel;
- a plain linear: the bf16 GEMV at one row (gemv.py);
- otherwise, and where a quantized path does not take the call: the separate fused kernel, then the
  layer.
"""

from __future__ import annotations

import torch

from podium_plugin_api.quantization import quantized_call

from . import fp8_linear, gemv, int4
from .prologue import ADD_RMSNORM, RMSNORM, SILU
from .tuning import CUDA_TUNING, KernelTuning


def _quantized(x, prologue, residual, weight, eps, linear, tuning):
    """The quantized kernels' (out, x + residual or None), or None where none takes the call."""
    call = quantized_call(linear)
    if call is None:
        return None
    op, args = call
    if op == "fp8_linear":
        return fp8_linear.prologue_linear(x, prologue, residual, weight, eps, *args, tuning=tuning)
    if op == "int4_linear":
        return int4.prologue_linear(x, prologue, residual, weight, eps, *args, tuning=tuning)
    return None


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    linear: torch.nn.Module, tuning: KernelTuning = CUDA_TUNING):
    """(linear(rms_norm(x + residual)), x + residual); residual None: (linear(rms_norm(x)), x)."""
    fused = _quantized(x, RMSNORM if residual is None else ADD_RMSNORM, residual, weight, eps, linear, tuning)
    if fused is None:
        return gemv.rms_norm_linear(x, residual, weight, eps, linear, tuning)
    out, summed = fused
    return out, x if residual is None else summed


def silu_and_mul_linear(x: torch.Tensor, linear: torch.nn.Module, tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """linear(silu(gate) * up) for x [T, 2I] = [gate | up]."""
    fused = _quantized(x, SILU, None, None, 0.0, linear, tuning)
    if fused is None:
        return gemv.silu_and_mul_linear(x, linear, tuning)
    return fused[0]


FUSED_LINEAR_OPS = {"rms_norm_linear": rms_norm_linear, "silu_and_mul_linear": silu_and_mul_linear}
