"""A batch-invariant GEMM in Triton: ``out [M, N] = x [M, K] @ w [N, K]^T (+ bias)`` whose every
output element is summed in one order whatever M is.

cuBLAS picks its kernel, tile and split-K from the problem's M, so the same row of x can be reduced
in another order inside a batch of 256 than alone, and in bf16 the last bit differs. Here the
tiling is a function of (N, K, dtype) only (``_config``): BLOCK_N x BLOCK_K tiles, BLOCK_M rows a
program, one program per output tile walking K from 0 to K in BLOCK_K steps with one float32
accumulator, no split-K. Rows past M are masked loads of zeros, so a row's sums see the same
instructions in every M. The output is rounded once, after the bias is added in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

INVARIANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _config(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): from the weight's shape and dtype, never from M."""
    block_k = 32 if dtype == torch.float32 else 64
    block_n = 128 if n >= 128 else max(16, triton.next_power_of_2(n))
    return 64, block_n, block_k, 4


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed by the batch-invariant GEMM (x [..., K], weight [N, K])."""
    if x.dtype != weight.dtype or x.dtype not in INVARIANT_DTYPES:
        raise ValueError(f"the batch-invariant GEMM takes x and weight of one dtype among "
                         f"{[str(d) for d in INVARIANT_DTYPES]}, got {x.dtype} and {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features; this weight takes {k}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)  # [M, N]
    if rows.shape[0]:
        block_m, block_n, block_k, warps = _config(n, k, x.dtype)
        grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(n, block_n))
        _gemm_kernel[grid](rows, w, bias if bias is not None else w, out, rows.shape[0], n, k, rows.stride(0),
                           w.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m,
                           BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out.reshape(*x.shape[:-1], n)


class InvariantLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` (same parameters) that multiplies with the batch-invariant GEMM."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def use_invariant_linears(model: nn.Module) -> int:
    """Every ``nn.Linear`` of ``model`` becomes an InvariantLinear in place; returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, InvariantLinear(child))
                count += 1
    return count
