"""The elementwise op a linear's kernel computes on its input before multiplying (its prologue).

A decoder feeds most projections from an RMSNorm (qkv: the input norm; gate_up: the post-attention
norm, both after adding the residual) or from SiLU-and-mul (down). The kernels that take the
linear's input rows (gemv.py's GEMV, the FP8 GEMV and activation quantization, the INT4 GEMV)
compute that op on the fly instead of reading its result from HBM:

    PLAIN        h = x
    RMSNORM      h = g * x / rms(x)
    ADD_RMSNORM  s = x + r (rounded to x's dtype; one program also writes it for the residual stream),
                 h = g * s / rms(s)
    SILU         x = [gate | up] (2K wide), h = silu(gate) * up

Every value is rounded to x's dtype where ``fused_ops``' separate kernels round theirs, so a fused
call equals "that kernel, then the linear" up to the order of the float32 sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAIN, RMSNORM, ADD_RMSNORM, SILU = 0, 1, 2, 3  # the kernels' PROLOGUE
_RMSNORM, _ADD_RMSNORM, _SILU = (tl.constexpr(v) for v in (RMSNORM, ADD_RMSNORM, SILU))


@triton.jit
def input_chunk(x_ptr, r_ptr, g_ptr, rstd, cols, ok, K, PROLOGUE: tl.constexpr):
    """The prologue's output at ``cols`` in float32, rounded to x's dtype where fused_ops rounds.

    ``x_ptr`` / ``r_ptr`` point at a row (scalars) or at rows ([ROWS, 1] pointer blocks, ``rstd``
    then [ROWS, 1] and ``cols`` [1, BLOCK]); ``g_ptr`` is the norm's weight."""
    if PROLOGUE == _SILU:  # x [2K] = [gate | up]
        gate = tl.load(x_ptr + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + K + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        h = (silu * up.to(tl.float32)).to(gate.dtype)
    else:
        h = tl.load(x_ptr + cols, mask=ok, other=0.0)
        if PROLOGUE == _ADD_RMSNORM:
            r = tl.load(r_ptr + cols, mask=ok, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        if PROLOGUE == _RMSNORM or PROLOGUE == _ADD_RMSNORM:
            normed = (h.to(tl.float32) * rstd).to(h.dtype).to(tl.float32)
            h = (normed * tl.load(g_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(h.dtype)
    return h.to(tl.float32)


@triton.jit
def rows_rstd(x_rows, r_rows, sum_rows, row_ok, K, eps, writer, PROLOGUE: tl.constexpr,
              NORM_BLOCK: tl.constexpr):
    """1 / rms of each row ([ROWS, 1] float32) for the norm prologues (1.0 otherwise); x_rows, r_rows,
    sum_rows: [ROWS, 1] pointers to each row's start. ADD_RMSNORM: the program whose ``writer`` is 0
    stores x + r at sum_rows (one program of a launch; the others pass their nonzero program id)."""
    if PROLOGUE == _RMSNORM or PROLOGUE == _ADD_RMSNORM:
        squares = tl.zeros(x_rows.shape, dtype=tl.float32)
        for c0 in range(0, K, NORM_BLOCK):
            cols = c0 + tl.arange(0, NORM_BLOCK)[None, :]
            ok = row_ok & (cols < K)
            x = tl.load(x_rows + cols, mask=ok, other=0.0)
            if PROLOGUE == _ADD_RMSNORM:
                x = (x.to(tl.float32) + tl.load(r_rows + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
                tl.store(sum_rows + cols, x, mask=ok & (cols * 0 + writer == 0))  # (a scalar mask term: the interpreter refuses it on 2D)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, 1, keep_dims=True)
        return 1.0 / tl.sqrt(squares / K + eps)
    return tl.full(x_rows.shape, 1.0, tl.float32)


@triton.jit
def pick(values, rows, m):
    """values[m] of a [ROWS, 1] tensor, as a scalar (a row of a register tensor cannot be indexed)."""
    return tl.sum(tl.sum(tl.where(rows == m, values, 0.0), 1), 0)
