"""Linear layers for few rows (batch-1 and small-batch decode): one Triton pass over the weight.

At a handful of rows a linear layer is a matrix-vector product bounded by reading the weight once;
``skinny_linear`` tiles the weight's output rows over programs (``BLOCK_N`` each, no split over K,
so a row's result never depends on how many other rows the batch holds) and streams K in
``BLOCK_K`` steps with the rows padded to one tensor-core tile. ``SkinnyLinear`` replaces an
``nn.Linear`` (``CudaPlatform.prepare_model``) and sends inputs of at most ``max_rows`` rows here,
larger ones to cuBLAS; under CUDA graphs the choice is made once per captured batch size.
Whether and up to how many rows this is used is a measured setting: ``KernelTuning.skinny_max_rows``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from .tuning import CUDA_TUNING, KernelTuning, SkinnyTiling, next_power_of_2

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["rows"])
def skinny_gemm_kernel(
    out_ptr, x_ptr, w_ptr, bias_ptr,  # out [M, N]; x [M, K]; w [N, K] (nn.Linear layout); bias [N]
    rows, n, k, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    m_ok = m < rows
    n_ok = cols < n
    x_ptrs = x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + kk[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + kk) < k
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + m[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def pick_tiling(n: int, k: int, tuning: KernelTuning) -> SkinnyTiling:
    """The widest BLOCK_N that still gives every multiprocessor ``programs_per_sm`` programs."""
    t = tuning.skinny
    block_n = t.max_block_n
    while block_n > t.min_block_n and triton.cdiv(n, block_n) < t.target_programs:
        block_n //= 2
    return SkinnyTiling(block_n=block_n, block_k=min(t.block_k, max(next_power_of_2(k), 16)),
                        num_warps=t.num_warps, num_stages=t.num_stages)


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    tiling: SkinnyTiling | None = None, tuning: KernelTuning = CUDA_TUNING,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] with M <= 16 (rows padded to one 16-row tile)."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"skinny_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias disagree")
    if rows > 16:
        raise ValueError(f"skinny_linear handles at most 16 rows, got {rows}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("skinny_linear: weight rows must be contiguous")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    tiling = tiling or pick_tiling(n, k, tuning)
    skinny_gemm_kernel[(triton.cdiv(n, tiling.block_n),)](
        out, x, weight, bias if bias is not None else weight,
        rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % tiling.block_k == 0, IEEE=x.dtype == torch.float32,
        BLOCK_M=16, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    return out


class SkinnyLinear(nn.Module):
    """An ``nn.Linear``'s parameters; at most ``max_rows`` rows go through ``skinny_linear``."""

    def __init__(self, linear: nn.Linear, max_rows: int, tuning: KernelTuning = CUDA_TUNING) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters (tied heads stay tied)
        self.max_rows = max_rows
        self.tiling = pick_tiling(self.out_features, self.in_features, tuning)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == self.weight.dtype:
            return skinny_linear(x, self.weight, self.bias, tiling=self.tiling)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, skinny<={self.max_rows}"


def use_skinny_linears(model: nn.Module, tuning: KernelTuning = CUDA_TUNING) -> int:
    """Swap every ``nn.Linear`` with GPU weights in a kernel dtype for a ``SkinnyLinear``; returns the count."""
    if tuning.skinny_max_rows <= 0:
        return 0
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child.weight.is_cuda and child.weight.dtype in KERNEL_DTYPES:
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        setattr(parent, name, SkinnyLinear(child, tuning.skinny_max_rows, tuning))
    return len(swaps)
