"""FP8 W8A8's per-token activation quantization (``podium_plugin_api.fp8.quantize_per_token``) in one launch,
with the norm or SiLU-and-mul before the linear as its prologue (prologue.py).

The contract's function is six float32 elementwise launches (upcast, abs, amax, divide, clamp, cast);
ahead of ``_scaled_mm`` they cost more than the GEMM itself at a few hundred rows. Here one program
per row reads the row (and the residual, or gate and up), computes the prologue's output ``h``
rounded to the activations' dtype as the separate kernel would store it, its amax, ``s = amax / 448``
(1 for an all-zero row) and writes ``e4m3(h / s)`` and ``s``: the bytes the contract's function
returns for that ``h``, exactly (IEEE division, round to nearest even). ADD_RMSNORM also writes
``x + r`` for the residual stream. The row is walked in chunks three times (norm, amax, quantize);
after the first the chunks come from L1/L2, so HBM sees one read of the inputs and one write.

``e4m3``: on the GPU the hardware conversion (``cvt.rn.satfinite``, what torch does); under Triton's
interpreter, whose fp8 cast rounds ties away from zero, the value is rounded in float32 first
(``fp8_gemm._round_e4m3``) so that the cast is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from podium_plugin_api.fp8 import FP8

from .fp8_gemm import _round_e4m3, interpreting
from .pdl import dependent_launch, gdc_launch_dependents, gdc_wait, launch_options
from .prologue import ADD_RMSNORM, PLAIN, RMSNORM, SILU, input_chunk, rows_rstd
from .tuning import next_power_of_2

MAX_BLOCK = 4096  # columns a program holds at once; wider rows are walked in chunks of it


@triton.jit
def to_e4m3(v, HW_CAST: tl.constexpr):
    """float32 v in [-448, 448] -> float8e4nv, rounded to nearest even."""
    if HW_CAST:
        return v.to(tl.float8e4nv)
    return _round_e4m3(v).to(tl.float8e4nv)


@triton.jit
def e4m3_values(v, HW_CAST: tl.constexpr):
    """float32 v -> e4m3(clamp(v, -448, 448)) as float32: the values a W8A8 product multiplies."""
    return to_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0), HW_CAST).to(tl.float32)


@triton.jit
def rows_scale(x_rows, r_rows, g_ptr, rstd, row_ok, K, PROLOGUE: tl.constexpr, BLOCK: tl.constexpr):
    """Each row's s = max|h| / 448 (1 where the row is all zero), [ROWS, 1] float32."""
    amax = tl.zeros(x_rows.shape, dtype=tl.float32)
    for c0 in range(0, K, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        h = input_chunk(x_rows, r_rows, g_ptr, rstd, cols, row_ok & (cols < K), K, PROLOGUE)
        amax = tl.maximum(amax, tl.max(tl.abs(h), 1, keep_dims=True))
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def quantize_kernel(q_ptr, s_ptr, sum_ptr, x_ptr, r_ptr, g_ptr, K, stride_x, stride_r, eps,
                    BLOCK: tl.constexpr, PROLOGUE: tl.constexpr, HW_CAST: tl.constexpr, PDL: tl.constexpr):
    """q [M, K] e4m3 (row stride K), s [M] float32 of prologue(x); grid (M,). PDL: launched as a
    dependent (pdl.py), the next launch let in at once."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    one = tl.zeros([1, 1], dtype=tl.int64)  # the row's pointers as [1, 1] blocks: the helpers take rows
    x_rows = x_ptr + row * stride_x + one
    r_rows = r_ptr + row * stride_r + one
    row_ok = one == 0
    rstd = rows_rstd(x_rows, r_rows, sum_ptr + row * K + one, row_ok, K, eps, 0, PROLOGUE, BLOCK)
    s = rows_scale(x_rows, r_rows, g_ptr, rstd, row_ok, K, PROLOGUE, BLOCK)
    for c0 in range(0, K, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]
        ok = cols < K
        h = input_chunk(x_rows, r_rows, g_ptr, rstd, cols, ok, K, PROLOGUE)
        v = tl.minimum(tl.maximum(tl.math.div_rn(h, s), -448.0), 448.0)
        tl.store(q_ptr + row * K + cols, to_e4m3(v, HW_CAST), mask=ok)
    tl.store(s_ptr + row + one, s)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def quantize(x: torch.Tensor, prologue: int = PLAIN, residual: torch.Tensor | None = None,
             weight: torch.Tensor | None = None, eps: float = 0.0, num_warps: int = 0,
             pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """prologue(x) quantized per token: (q e4m3 [M, K], s float32 [M, 1], x + residual or None).

    x [M, K] (SILU: [M, 2K] = [gate | up]); RMSNORM / ADD_RMSNORM take the norm's ``weight`` [K] and
    ``eps``, ADD_RMSNORM the ``residual`` [M, K] too. ``num_warps`` 0: by the row's width. ``pdl``: a
    programmatic dependent launch where the device has them (a GEMV behind it can load its weights
    while this runs)."""
    x = _rows(x)
    rows = x.shape[0]
    k = x.shape[1] // 2 if prologue == SILU else x.shape[1]
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    summed = None
    if prologue == ADD_RMSNORM:
        if residual is None or residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"quantize: residual {None if residual is None else tuple(residual.shape)} must match "
                             f"x {tuple(x.shape)} {x.dtype}")
        residual = _rows(residual)
        summed = torch.empty_like(x)
    if prologue in (RMSNORM, ADD_RMSNORM) and (weight is None or weight.shape != (k,)):
        raise ValueError(f"quantize: the norm's weight must be [{k}]")
    if rows:
        pdl = pdl and dependent_launch(x.device)
        block = min(MAX_BLOCK, next_power_of_2(k))
        quantize_kernel[(rows,)](
            q, s, summed if summed is not None else x, x, residual if residual is not None else x,
            weight if weight is not None else x, k, x.stride(0), residual.stride(0) if residual is not None else 0,
            float(eps), BLOCK=block, PROLOGUE=prologue, HW_CAST=not interpreting(), PDL=pdl,
            num_warps=num_warps or max(4, min(block // 256, 16)), **launch_options(pdl))
    return q, s, summed


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's ``quantize_per_token`` in one launch: x [M, K] -> (e4m3 [M, K], float32 [M, 1])."""
    q, s, _ = quantize(x)
    return q, s

