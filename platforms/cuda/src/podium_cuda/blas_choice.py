"""cuBLAS or cuBLASLt for each linear layer, chosen by timing both when the model is loaded.

torch runs a bf16/fp16 matmul through cuBLAS or cuBLASLt (``torch.backends.cuda.preferred_blas_library``);
the two libraries' heuristics pick different kernels and neither wins everywhere. On the H200 with
Llama-3.1-8B shapes (platforms/cuda/NOTES.md), cuBLASLt ran the down projection 15% faster at 256
rows and the fused q|k|v projection 14% slower at 8,192 rows. ``choose_blas_libraries`` times every
distinct weight shape of the model with both libraries at one row count per class (batch-1 decode,
a large decode batch, a prefill chunk) and wraps the linears for which cuBLASLt is faster in some
class: ``BlasChoiceLinear`` switches the library around its own call only. Under CUDA graphs the
library a captured call used is the one replayed.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

logger = logging.getLogger("podium_cuda.blas_choice")

ROW_CLASSES = (1, 256, 8192)  # batch-1 decode, a large decode batch, a prefill chunk
MIN_GAIN = 0.03  # cuBLASLt must be at least 3% faster to be used
MAX_OUTPUT_BYTES = 1 << 30  # skip timing a class whose output would exceed this (an lm_head at 8,192 rows)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def row_class(rows: int) -> int:
    """The representative row count of a call: classes split at the geometric midpoints (16, 1448)."""
    if rows < 16:
        return ROW_CLASSES[0]
    return ROW_CLASSES[1] if rows < 1448 else ROW_CLASSES[2]


@contextmanager
def preferred_library(name: str):
    """``torch.backends.cuda.preferred_blas_library(name)`` inside the block, the previous one after."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


class BlasChoiceLinear(nn.Module):
    """An ``nn.Linear``'s parameters; calls whose row class is in ``lt_classes`` run on cuBLASLt."""

    def __init__(self, linear: nn.Linear, lt_classes: frozenset[int]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters (tied heads stay tied)
        self.lt_classes = lt_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.is_cuda and row_class(rows) in self.lt_classes:
            with preferred_library("cublaslt"):
                return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        classes = ",".join(str(c) for c in sorted(self.lt_classes))
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, cublaslt_rows={classes}"


def time_library(linear: nn.Linear, rows: int, library: str, repeats: int = 8) -> float:
    """Median milliseconds of one ``F.linear`` call at ``rows`` rows on ``library`` (after a warm-up)."""
    x = torch.randn(rows, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
    times = []
    with preferred_library(library), torch.inference_mode():
        for i in range(repeats + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            F.linear(x, linear.weight, linear.bias)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
    return statistics.median(times)


def lt_classes_for(linear: nn.Linear, timer: Callable[[nn.Linear, int, str], float] = time_library) -> frozenset[int]:
    """Row classes where cuBLASLt beats cuBLAS by ``MIN_GAIN`` for this linear's shape."""
    chosen = set()
    for rows in ROW_CLASSES:
        if rows * linear.out_features * linear.weight.element_size() > MAX_OUTPUT_BYTES:
            continue
        cublas, cublaslt = timer(linear, rows, "cublas"), timer(linear, rows, "cublaslt")
        if cublaslt < cublas * (1 - MIN_GAIN):
            chosen.add(rows)
    return frozenset(chosen)


def choose_blas_libraries(model: nn.Module, timer: Callable[[nn.Linear, int, str], float] = time_library,
                          device_type: str = "cuda") -> dict[tuple, frozenset[int]]:
    """Wrap the model's bf16/fp16 linears where cuBLASLt is faster; returns {(out, in, dtype, bias): classes}.

    Each distinct shape is timed once (a Llama has five: q|k|v, o, gate|up, down, lm_head).
    """
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child.weight.dtype in KERNEL_DTYPES and child.weight.device.type == device_type:
                found.append((parent, name, child))
    choices: dict[tuple, frozenset[int]] = {}
    for parent, name, child in found:
        key = (child.out_features, child.in_features, child.weight.dtype, child.bias is not None)
        if key not in choices:
            choices[key] = lt_classes_for(child, timer)
        if choices[key]:
            setattr(parent, name, BlasChoiceLinear(child, choices[key]))
    torch.cuda.empty_cache()
    if choices:
        logger.info("cuBLASLt rows per linear shape (others on cuBLAS): %s",
                    {f"{out}x{inp}": sorted(c) for (out, inp, _, _), c in choices.items() if c})
    return choices
