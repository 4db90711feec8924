"""A batch-invariant GEMM in Triton: ``out [M, N] = x [M, K] @ w [N, K]^T (+ bias)`` whose every
output element is summed in one order whatever M is.

cuBLAS picks its kernel, tile and split-K from the problem's M, so the same row of x can be reduced
in another order inside a batch of 256 than alone, and in bf16 the last bit differs. Here kernel and
tiling are a function of (N, K, dtype) only (``choose_tiling``, from ``KernelTuning.invariant_gemm``,
a ``GemmPlan``): BLOCK_N x BLOCK_K tiles, BLOCK_M rows, each output tile's K walked from 0 to K in
BLOCK_K steps into one float32 accumulator, no split-K. Two kernels: ``tiles`` (here: one program
per output tile, masked pointer loads; any GPU, and every shape) and ``tma`` / ``tma_ws``
(invariant_gemm_tma.py: persistent programs, TMA loads; Hopper, 16-bit weights whose rows are
whole 16-byte units). Rows past M are zeros (masked loads, or the descriptor's fill), so a row's sums see
the same instructions in every M (M is not specialized on, so one compiled variant serves every M).
The output is rounded once, after the bias is added in float32. float32 multiplies in IEEE float32,
not TF32, as F.linear does by default.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch import nn

from .gemm_plan import GemmPlan, GemmTiling
from .invariant_gemm_tma import tma_fits, tma_linear
from .tuning import CUDA_TUNING, KernelTuning

INVARIANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ks = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the one fixed order of every element's sum
        kk = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :],
                    mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)  # [BN, BK]
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


NARROW_BELOW = 64  # column tiles under which a weight's tiles are halved in width (see _adapted)


def _adapted(n: int, dtype: torch.dtype, tiling: GemmTiling) -> GemmTiling:
    """The plan's default tiling fitted to a weight of ``n`` output features and ``dtype``: from its
    shape and dtype, never from M.

    block_n halves (down to 64) while the weight has fewer than NARROW_BELOW column tiles: a
    4096-wide projection in 128-wide tiles gives a 256-row decode step 64 programs for ~132
    multiprocessors. float32 tiles take half the block_k (twice the bytes an element) and the
    pointer kernel (IEEE float32 products; the TMA kernel is measured on 16-bit weights only)."""
    block_n = min(tiling.block_n, max(16, triton.next_power_of_2(n)))
    while block_n > 64 and triton.cdiv(n, block_n) < NARROW_BELOW:
        block_n //= 2
    fp32 = dtype == torch.float32
    block_k = tiling.block_k // 2 if fp32 else tiling.block_k
    return replace(tiling, block_n=block_n, block_k=max(block_k, 16), kernel="tiles" if fp32 else tiling.kernel)


@functools.lru_cache(maxsize=1024)  # every linear of every step asks: a few microseconds saved a call
def choose_tiling(n: int, k: int, dtype: torch.dtype, device: torch.device, plan: GemmPlan) -> GemmTiling:
    """The tiling (and kernel) for a [n, k] weight: the plan's entry for 16-bit weights of that shape,
    else its default adapted; a TMA kernel where ``tma_fits``, else the pointer kernel with the
    default's tiles. A function of (n, k, dtype, device, plan) alone."""
    entry = plan.entry(n, k) if dtype != torch.float32 else None
    tiling = entry or _adapted(n, dtype, plan.default)
    if tiling.kernel != "tiles" and not tma_fits(n, k, dtype, device):
        tiling = replace(_adapted(n, dtype, plan.default), kernel="tiles")
    return tiling


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed by the batch-invariant GEMM (x [..., K], weight [N, K]);
    kernel and tiles from ``tuning.invariant_gemm`` (``choose_tiling``)."""
    if x.dtype != weight.dtype or x.dtype not in INVARIANT_DTYPES:
        raise ValueError(f"the batch-invariant GEMM takes x and weight of one dtype among "
                         f"{[str(d) for d in INVARIANT_DTYPES]}, got {x.dtype} and {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features; this weight takes {k}")
    rows = x.reshape(-1, k)
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)  # [M, N]
    if rows.shape[0]:
        linear_with(choose_tiling(n, k, x.dtype, x.device, tuning.invariant_gemm), rows, weight, bias, out)
    return out.reshape(*x.shape[:-1], n)


def linear_with(t: GemmTiling, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor):
    """``out [M, N] = rows [M, K] @ weight^T (+ bias)`` by the kernel and tiles ``t`` (M > 0; for a
    TMA kernel ``tma_fits`` must hold); returns the compiled kernel Triton launched. Benchmarks and
    tests call it to run one tiling exactly."""
    if t.kernel != "tiles":
        return tma_linear(rows, weight, bias, out, t)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    (m, k), n = rows.shape, w.shape[0]
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))  # row tiles of a column next
    return _gemm_kernel[grid](rows, w, bias if bias is not None else w, out, m, n, k, rows.stride(0),
                              w.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=t.block_m,
                              BLOCK_N=t.block_n, BLOCK_K=t.block_k, IEEE=rows.dtype == torch.float32,
                              num_warps=t.num_warps, num_stages=t.num_stages)


class InvariantLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` (same parameters) that multiplies with the batch-invariant GEMM."""

    def __init__(self, linear: nn.Linear, tuning: KernelTuning = CUDA_TUNING) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.tuning = tuning

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias, self.tuning)


def use_invariant_linears(model: nn.Module, tuning: KernelTuning = CUDA_TUNING) -> int:
    """Every ``nn.Linear`` of ``model`` becomes an InvariantLinear in place; returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, InvariantLinear(child, tuning))
                count += 1
    return count
