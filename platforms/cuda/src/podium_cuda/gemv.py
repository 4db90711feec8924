"""Batch-1 linears as a Triton GEMV, with the norm or SiLU-mul before them fused into its prologue.

At one row (a batch-1 decode step) cuBLAS's GEMMs are latency-bound on the small projections, and
each elementwise op before them is one more launch and one more round trip through HBM. Here a
program owns BLOCK_N output features and walks K in [BLOCK_N, BLOCK_K] weight tiles, multiplying
elementwise and reducing with ``tl.sum`` (no ``tl.dot``: nothing to pad to 16 rows). The norm
prologue recomputes the row's sum of squares in every program (the row is K elements, in L2), so
no program waits on another; program 0 also writes ``x + residual``.

On the H200, at 1 row it is faster than "separate Triton kernel + cuBLAS" on every Llama-3.2-1B /
3.1-8B (shape, prologue) pair; at 2 rows it ties and at 4 it loses (register pressure), so only 1-row
calls take it (``KernelTuning.gemv_batch1``).
Every value is rounded where ``fused_ops``' separate kernels round theirs, so a fused call equals
"that kernel, then a linear" up to the order of the fp32 sums.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from .fused_ops import fused_add_rms_norm, rms_norm, silu_and_mul
from .pdl import dependent_launch, gdc_launch_dependents, gdc_wait, launch_options
from .prologue import _ADD_RMSNORM, _RMSNORM, ADD_RMSNORM, PLAIN, RMSNORM, SILU
from .prologue import input_chunk as _input_chunk
from .tuning import CUDA_TUNING, KernelTuning, next_power_of_2

GEMV_DTYPES = (torch.bfloat16, torch.float16)  # where it was measured; float32 keeps cuBLAS (tests)
MAX_BLOCK_K = 2048


@triton.jit
def _weight_tile(w_rows, k, k_ok, n_ok, EVEN: tl.constexpr):
    """W[n, k] [BLOCK_N, BLOCK_K] in float32."""
    if EVEN:
        return tl.load(w_rows + k[None, :]).to(tl.float32)
    return tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def gemv_kernel(
    out_ptr, sum_ptr, w_ptr, b_ptr, x_ptr, r_ptr, g_ptr, N, K, stride_w, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):
    """out [N] = prologue(x) [K] @ W^T (+ bias); W [N, K] row-major. Grid: cdiv(N, BLOCK_N).

    ADD_RMSNORM: x + r is rounded to x's dtype, normed, times g; program 0 writes x + r to sum_ptr.
    EVEN: N % BLOCK_N == 0 and K % BLOCK_K == 0, so weight loads need no mask.
    PDL (launched as a programmatic dependent launch, sm90+): the first weight tile, which no kernel
    writes, is requested before ``gdc_wait`` (the previous kernel finished, its writes visible); x, r
    and every store come after it. The kernel lets the next one launch from its start.
    """
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    k = tl.arange(0, BLOCK_K)
    w = _weight_tile(w_rows, k, k < K, n_ok, EVEN)  # the first tile, before anything a prior kernel writes
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rstd = 1.0
    if PROLOGUE == _RMSNORM or PROLOGUE == _ADD_RMSNORM:
        squares = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        for c0 in range(0, K, NORM_BLOCK):
            cols = c0 + tl.arange(0, NORM_BLOCK)
            ok = cols < K
            x = tl.load(x_ptr + cols, mask=ok, other=0.0)
            if PROLOGUE == _ADD_RMSNORM:
                x = (x.to(tl.float32) + tl.load(r_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
                tl.store(sum_ptr + cols, x, mask=ok & (pid == 0))
            xf = x.to(tl.float32)
            squares += xf * xf
        rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
    acc = tl.sum(w * _input_chunk(x_ptr, r_ptr, g_ptr, rstd, k, k < K, K, PROLOGUE)[None, :], 1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = _weight_tile(w_rows, k, k_ok, n_ok, EVEN)
        acc += tl.sum(w * _input_chunk(x_ptr, r_ptr, g_ptr, rstd, k, k_ok, K, PROLOGUE)[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


H200_MULTIPROCESSORS = 132  # what the configs were tuned on; assumed under Triton's interpreter (CPU tensors)


@cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_config(n: int, k: int, multiprocessors: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight.

    4 x 2048 with 4 warps was within ~5% of the sweep's best at every 1B/8B shape but two: when
    4-feature programs would leave fewer than four a multiprocessor (N of 2048: 1B's o and down),
    2-feature programs were 3-9% faster, with 8 warps over K of 8192 (1B down).
    """
    block_k = min(MAX_BLOCK_K, next_power_of_2(k))
    if triton.cdiv(n, 4) >= 4 * multiprocessors:
        return 4, block_k, 4
    return 2, block_k, 8 if k >= 8192 else 4


def _dense(linear: nn.Module, dtype: torch.dtype) -> bool:
    """A plain linear (weight [N, K] row-major, in x's dtype) this kernel can read directly."""
    if type(linear) not in (nn.Linear, BatchOneLinear):
        return False
    w = linear.weight
    return w.dtype == dtype and w.stride(1) == 1 and (linear.bias is None or linear.bias.dtype == dtype)


def takes_gemv(x: torch.Tensor, linear: nn.Module, tuning: KernelTuning) -> bool:
    """Whether a call with input ``x`` [rows, width] goes to the GEMV: one row, bf16/fp16, a plain linear."""
    return (tuning.gemv_batch1 and x.dim() == 2 and x.shape[0] == 1 and x.dtype in GEMV_DTYPES
            and x.stride(-1) == 1 and _dense(linear, x.dtype))


def _launch(prologue: int, x, linear, tuning, residual=None, weight=None, eps=0.0, summed=None) -> torch.Tensor:
    w, bias = linear.weight, linear.bias
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = gemv_config(n, k, _multiprocessors(x.device))
    pdl = tuning.gemv_pdl and dependent_launch(x.device)
    gemv_kernel[(triton.cdiv(n, block_n),)](
        out, summed if summed is not None else out, w, bias if bias is not None else w, x,
        residual if residual is not None else x, weight if weight is not None else x, n, k, w.stride(0), float(eps),
        BLOCK_N=block_n, BLOCK_K=block_k, NORM_BLOCK=min(MAX_BLOCK_K, next_power_of_2(k)), PROLOGUE=prologue,
        HAS_BIAS=bias is not None, EVEN=n % block_n == 0 and k % block_k == 0, PDL=pdl, num_warps=warps,
        **launch_options(pdl),
    )
    return out


def gemv(x: torch.Tensor, linear: nn.Module, tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """linear(x) for one row x [1, K] of a plain linear (``takes_gemv``)."""
    return _launch(PLAIN, x, linear, tuning)


def rms_norm_linear(x, residual, weight, eps, linear, tuning: KernelTuning = CUDA_TUNING):
    """(linear(rms_norm(x + residual)), x + residual); one GEMV launch at one row (podium_plugin_api.ops;
    fused_linear.py installs it, quantized layers first going to their own kernels)."""
    if not takes_gemv(x, linear, tuning) or weight.dtype != x.dtype or x.shape[1] != linear.in_features:
        if residual is None:
            return linear(rms_norm(x, weight, eps, tuning)), x
        normed, summed = fused_add_rms_norm(x, residual, weight, eps, tuning)
        return linear(normed), summed
    if residual is None:
        return _launch(RMSNORM, x, linear, tuning, weight=weight, eps=eps), x
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"rms_norm_linear: residual {tuple(residual.shape)} {residual.dtype} must match x")
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    summed = torch.empty_like(x)
    return _launch(ADD_RMSNORM, x, linear, tuning, residual, weight, eps, summed), summed


def silu_and_mul_linear(x, linear, tuning: KernelTuning = CUDA_TUNING):
    """linear(silu(gate) * up) for x [T, 2I] = [gate | up]; one GEMV launch at one row."""
    if not takes_gemv(x, linear, tuning) or x.shape[1] != 2 * linear.in_features:
        return linear(silu_and_mul(x, tuning))
    return _launch(SILU, x, linear, tuning)


class BatchOneLinear(nn.Linear):
    """nn.Linear whose one-row bf16/fp16 calls run the GEMV (o_proj, lm_head); others F.linear.

    ``prepare_model`` turns a model's plain linears into these in place (same parameters) and gives
    each the platform's ``tuning``.
    """

    tuning: KernelTuning = CUDA_TUNING

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_gemv(x, self, self.tuning):
            return gemv(x, self, self.tuning)
        return F.linear(x, self.weight, self.bias)


def use_batch_one_linears(model: nn.Module, tuning: KernelTuning = CUDA_TUNING) -> int:
    """Make every plain nn.Linear of ``model`` a BatchOneLinear launched with ``tuning`` (parameters
    kept); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BatchOneLinear
            module.tuning = tuning
            count += 1
    return count

