"""Linear layers with weights pre-packed at load for the kernel that multiplies them: a native C
kernel (``NativeLinear``: AMX tiles, AVX512-BF16 dot products or FMA units) or oneDNN's packed
matmul (``onednn_linear.PackedLinear``). Which one runs for a dtype, and for how many rows, is
``linear_choice``'s rule; this module applies it.

Weight layouts (the native packers write them in one parallel pass at load; without a packer torch
pads and permutes, the definition the packers are tested against):

    amx_tiles    bf16 [N/16, K/32, 16, 16, 2]  tiles of 16 outputs x 32 inputs, inputs k and k+1 of an
                 output side by side (AMX's B operand; a column block's pairs are also one vdpbf16ps
                 operand each, so the AVX512-BF16 kernel reads the same layout)
    fma_panels   bf16 [N/16, K, 16]  panels of 16 outputs, k-major, a k's 16 columns in FMA_COLUMN_ORDER
    f32_panels   float32 [G*4, K, 16]  the same in natural column order, N padded to G * 64

A native layer keeps the usual ``weight`` parameter too (state_dict, tied embeddings, and the
batches above the kernel's row limit, which go to ``F.linear``). This is a transformation applied
to a loaded model (``pack_linear_layers``); the model's modules keep their names and parameters,
so nothing else changes. Re-loading weights afterwards would leave the packed copies stale: pack last.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .onednn_linear import PackedLinear

if TYPE_CHECKING:
    from .linear_choice import LinearRule


def amx_tiles(weight: torch.Tensor, pack=None) -> torch.Tensor:
    """weight [N, K] bf16 -> [N/16, K/32, 16, 16, 2], zero padded to N % 32 == 0 and K % 32 == 0."""
    n, k = weight.shape
    n_pad, k_pad = n + -n % 32, k + -k % 32
    if pack is not None:
        source = weight.detach().contiguous()  # alive through the call
        tiles = torch.empty(n_pad // 16, k_pad // 32, 16, 16, 2, dtype=torch.bfloat16)
        pack(source.data_ptr(), n, k, tiles.data_ptr(), torch.get_num_threads())
        return tiles
    padded = F.pad(weight.detach(), (0, k_pad - k, 0, n_pad - n))  # [Np, Kp]
    return padded.view(n_pad // 16, 16, k_pad // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


# the column each of a bf16 panel's 16 slots holds: what AVX2's in-lane 16-bit unpacks with zero
# widen into columns 0-7 (unpacklo) and 8-15 (unpackhi) (fma_linear.c's SLOT)
FMA_COLUMN_ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
F32_GROUP_COLUMNS = 64  # f32_panels pads N to a multiple of this (fma_linear.c: 4 panels a register block)


def _panels(weight: torch.Tensor, multiple: int, order: list[int] | None, pack) -> torch.Tensor:
    """weight [N, K] -> [Np/16, K, 16] (Np: N padded to ``multiple``), columns of a panel in ``order``."""
    n, k = weight.shape
    n_pad = n + -n % multiple
    if pack is not None:
        source = weight.detach().contiguous()  # alive through the call
        panels = torch.empty(n_pad // 16, k, 16, dtype=weight.dtype)
        pack(source.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
        return panels
    padded = F.pad(weight.detach(), (0, 0, 0, n_pad - n))  # [Np, K]
    panels = padded.view(n_pad // 16, 16, k).transpose(1, 2)  # [P, K, 16], columns in order
    return (panels if order is None else panels[:, :, order]).contiguous()


def fma_panels(weight: torch.Tensor, pack=None) -> torch.Tensor:
    """weight [N, K] bf16 -> [N/16, K, 16], zero rows padding N to N % 16 == 0, FMA_COLUMN_ORDER."""
    return _panels(weight, 16, FMA_COLUMN_ORDER, pack)


def f32_panels(weight: torch.Tensor, pack=None) -> torch.Tensor:
    """weight [N, K] float32 -> [Np/16, K, 16], zero rows padding N to a multiple of 64, columns in order."""
    return _panels(weight, F32_GROUP_COLUMNS, None, pack)


@dataclass(frozen=True)
class NativeKernel:
    """One native linear kernel for one dtype: its C entries (``NativeKernels``), the weight layout it
    reads, and the batches it takes (``max_rows``; None: every batch)."""

    name: str  # "amx", "avx512-bf16", "fma"
    dtype: torch.dtype
    linear: Callable  # x . w^T + bias (linear.h)
    fused: Callable  # the same with RMSNorm or SiLU-mul in its input pass
    pack: Callable | None  # the layout's native packer
    layout: Callable[..., torch.Tensor]  # (weight, pack) -> packed weight
    max_rows: int | None = None

    def takes(self, rows: int) -> bool:
        return rows > 0 and (self.max_rows is None or rows <= self.max_rows)


class NativeLinear(nn.Module):
    """Drop-in for an ``nn.Linear``: same parameters, ``kernel`` over weights packed once at load for
    2-D-able inputs of its dtype whose batch it takes; anything else goes to ``F.linear``."""

    def __init__(self, linear: nn.Linear, kernel: NativeKernel) -> None:
        super().__init__()
        if linear.weight.dtype != kernel.dtype or linear.weight.device.type != "cpu":
            raise ValueError(f"the {kernel.name} linear kernel needs a {kernel.dtype} CPU weight, got "
                             f"{linear.weight.dtype} on {linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept: other batches, state_dict, tied references see the usual parameter
        self.bias = linear.bias
        self.kernel = kernel
        self.packed = kernel.layout(linear.weight, kernel.pack)
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()

    @property
    def kernel_name(self) -> str:
        return self.kernel.name

    def takes(self, rows: torch.Tensor) -> bool:
        """Whether the kernel computes these [M, in] rows (its dtype, contiguous rows, a batch it takes)."""
        return (rows.dtype == self.kernel.dtype and rows.dim() == 2 and rows.stride(-1) == 1
                and self.kernel.takes(rows.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x  # [M, in]
        if not self.takes(rows):
            return F.linear(x, self.weight, self.bias)
        if rows.shape[1] != self.in_features:
            raise ValueError(f"input has {rows.shape[1]} features; this layer takes {self.in_features}")
        out = torch.empty((rows.shape[0], self.out_features), dtype=rows.dtype)  # [M, out]
        bias = None if self.bias_f32 is None else self.bias_f32.data_ptr()
        rc = self.kernel.linear(rows.data_ptr(), rows.stride(0), rows.shape[0], self.packed.data_ptr(),
                                self.out_features, self.in_features, bias, out.data_ptr(), self.out_features,
                                torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"the {self.kernel.name} linear kernel could not allocate its scratch rows")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rows = "every batch" if self.kernel.max_rows is None else f"up to {self.kernel.max_rows} rows"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed={self.kernel.name} ({rows})")


def pack_linear_layers(model: nn.Module, rules: Mapping[torch.dtype, LinearRule]) -> int:
    """Replace the CPU ``nn.Linear`` modules of ``model`` as ``rules`` (``linear_choice.linear_rules``)
    say for their dtype: a ``NativeLinear`` where a native kernel runs, a ``PackedLinear`` where
    oneDNN's packed matmul does, unchanged otherwise. Returns how many were replaced."""
    makers: dict[torch.dtype, Callable[[nn.Linear], nn.Module]] = {}
    for dtype, rule in rules.items():
        if rule.native is not None:
            makers[dtype] = lambda child, kernel=rule.native: NativeLinear(child, kernel)
        elif rule.kernel == "onednn":
            makers[dtype] = PackedLinear
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            make = makers.get(child.weight.dtype) if type(child) is nn.Linear else None
            if make is not None and child.weight.device.type == "cpu":
                setattr(parent, name, make(child))
                count += 1
    return count
