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

One copy of each weight. A native layer keeps only its packed weight (a non-persistent buffer, so
``weight_bytes_by_dtype`` counts it); ``unpacked()`` inverts the layout exactly for whatever needs
the plain [out, in] weight back. A kernel with a row limit (AMX's; float32 FMA's on an AMX CPU)
hands the batches above it to oneDNN (``F.linear``) on the plain weight rebuilt from the tiles or
panels for that call (``unpacked_linear``: the layout's native unpack into one shared scratch of at
most ``UNPACK_SCRATCH_BYTES``, the LM head a slice of rows at a time), so the plain copy need not
stay resident: the unpack is a transpose of 32-bit words, against a matmul of hundreds of rows that
reads each weight element once per row. Where the layout has no native unpack the layer keeps the
plain ``weight`` parameter beside the packed one. A tied embedding (an ``nn.Embedding`` sharing the
head's weight, as SmolLM2's does) reads its rows from the head's packed copy (``PanelEmbedding``)
instead of holding a second table.

This is a transformation applied to a loaded model (``pack_linear_layers``): the modules keep their
names, so nothing else changes, but a packed-only layer has no ``weight`` in its state_dict.
Re-loading weights afterwards would leave the packed copies stale: pack last.
"""

from __future__ import annotations

import threading
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


def amx_tiles_unpacked(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``amx_tiles``' inverse: [N/16, K/32, 16, 16, 2] -> the [n, k] weight (padding dropped)."""
    blocks, k_blocks = tiles.shape[0], tiles.shape[1]
    plain = tiles.permute(0, 3, 1, 2, 4).reshape(blocks * 16, k_blocks * 32)  # [Np, Kp]
    return plain[:n, :k].contiguous()


def panels_unpacked(panels: torch.Tensor, n: int, order: list[int] | None = None) -> torch.Tensor:
    """``_panels``' inverse: [Np/16, K, 16] (columns in ``order``) -> the [n, K] weight."""
    if order is not None:  # slot s holds column order[s]: column c sits at slot order.index(c)
        panels = panels[:, :, [order.index(c) for c in range(16)]]
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n].contiguous()  # [Np, K] -> [n, K]


def unpacked_weight(layout: Callable, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The plain [n, k] weight that ``layout`` (amx_tiles, fma_panels or f32_panels) packed into ``packed``."""
    if layout is amx_tiles:
        return amx_tiles_unpacked(packed, n, k)
    if layout is fma_panels:
        return panels_unpacked(packed, n, FMA_COLUMN_ORDER)
    if layout is f32_panels:
        return panels_unpacked(packed, n)
    raise ValueError(f"no inverse for the weight layout {getattr(layout, '__name__', layout)!r}")


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
    rows: Callable | None = None  # embedding rows gathered from the layout (fused_ops.c's panel/tile rows)
    unpack: Callable | None = None  # plain rows rebuilt from the layout (fused_ops.c's tile / panel unpack)

    def takes(self, rows: int) -> bool:
        return rows > 0 and (self.max_rows is None or rows <= self.max_rows)

    @property
    def every_batch(self) -> bool:
        """Whether the kernel takes every batch."""
        return self.max_rows is None

    @property
    def packed_only(self) -> bool:
        """Whether its layers need no plain weight beside the packed one: the kernel takes every batch,
        or the layout rebuilds the plain weight for the batches it does not (``unpacked_linear``)."""
        return self.max_rows is None or self.unpack is not None


UNPACK_SCRATCH_BYTES = 8 << 20  # a decoder layer's largest weight fits (SmolLM2's gate_up: 3.4 MiB)
_scratch_lock = threading.Lock()
_scratch = torch.empty(0)  # the one shared unpack buffer, grown on demand (under the lock)


def unpacked_linear(unpack: Callable, packed: torch.Tensor, x: torch.Tensor, n: int, k: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with w [n, k] rebuilt by ``unpack`` from ``packed`` into the shared
    scratch, ``UNPACK_SCRATCH_BYTES`` at most at a time (slices of rows for a larger weight). x: [M, k]
    of the weight's dtype."""
    global _scratch
    step = max(16, UNPACK_SCRATCH_BYTES // (k * packed.element_size()) // 16 * 16)  # rows a slice
    threads = torch.get_num_threads()
    with _scratch_lock:
        if _scratch.numel() < min(n, step) * k or _scratch.dtype != packed.dtype:
            _scratch = torch.empty(min(n, step) * k, dtype=packed.dtype)

        def rows(n0: int, n1: int) -> torch.Tensor:  # x . w[n0:n1]^T + bias[n0:n1]
            w = _scratch[:(n1 - n0) * k].view(n1 - n0, k)
            if unpack(packed.data_ptr(), n, k, n0, n1, w.data_ptr(), k, threads) != 0:
                raise ValueError(f"cannot unpack rows {n0}-{n1} of a [{n}, {k}] packed weight")
            return F.linear(x, w, None if bias is None else bias[n0:n1])

        if n <= step:
            return rows(0, n)
        out = torch.empty((x.shape[0], n), dtype=x.dtype)
        for n0 in range(0, n, step):
            out[:, n0:n0 + step] = rows(n0, min(n, n0 + step))
        return out


class NativeLinear(nn.Module):
    """Drop-in for an ``nn.Linear``: ``kernel`` over weights packed once at load. With ``keep_weight``
    the plain ``weight`` parameter stays for the batches the kernel does not take (``F.linear``);
    without it the kernel computes every input it takes (cast and made contiguous where needed), the
    batches above its rows go to ``unpacked_linear``, and the plain weight exists only as
    ``unpacked()``."""

    def __init__(self, linear: nn.Linear, kernel: NativeKernel, keep_weight: bool = True) -> None:
        super().__init__()
        if linear.weight.dtype != kernel.dtype or linear.weight.device.type != "cpu":
            raise ValueError(f"the {kernel.name} linear kernel needs a {kernel.dtype} CPU weight, got "
                             f"{linear.weight.dtype} on {linear.weight.device}")
        if not keep_weight and not kernel.packed_only:
            raise ValueError(f"the {kernel.name} linear kernel takes up to {kernel.max_rows} rows and its layout has "
                             "no unpack; its layers keep the plain weight for larger batches")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if keep_weight:
            self.weight = linear.weight
        self.bias = linear.bias
        self.kernel = kernel
        self.register_buffer("packed", kernel.layout(linear.weight, kernel.pack), persistent=False)
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def __getattr__(self, name: str):
        if name == "weight" and "weight" not in self.__dict__["_parameters"]:
            raise AttributeError(f"this {self.kernel.name} linear keeps only its packed weight; unpacked() returns "
                                 "the plain [out, in] weight")
        return super().__getattr__(name)

    @property
    def keeps_weight(self) -> bool:
        return "weight" in self._parameters

    def unpacked(self) -> torch.Tensor:
        """The plain [out, in] weight, rebuilt from the packed layout (bit-exact; a new tensor)."""
        return unpacked_weight(self.kernel.layout, self.packed, self.out_features, self.in_features)

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
            if self.keeps_weight:
                return F.linear(x, self.weight, self.bias)
            if rows.shape[0] == 0:
                return x.new_empty(*x.shape[:-1], self.out_features)
            if not self.kernel.takes(rows.shape[0]):  # above the kernel's rows: oneDNN on the unpacked weight
                out = unpacked_linear(self.kernel.unpack, self.packed, rows.to(self.kernel.dtype), self.out_features,
                                      self.in_features, self.bias)
                return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return self(rows.to(self.kernel.dtype).contiguous()).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
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
                f"packed={self.kernel.name} ({rows}{', plain weight kept' if self.keeps_weight else ''})")


class PanelEmbedding(nn.Module):
    """An ``nn.Embedding`` tied to a packed-only ``NativeLinear`` head: its rows read from the head's
    packed weight by the layout's native gather (``NativeKernel.rows``), the same values as the plain
    table's; ids out of range raise IndexError, as ``F.embedding`` does."""

    def __init__(self, head: NativeLinear) -> None:
        super().__init__()
        if head.kernel.rows is None:
            raise ValueError(f"the {head.kernel.name} layout has no native row gather for {head.kernel.dtype}")
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.rows = head.kernel.rows
        self.register_buffer("packed", head.packed, persistent=False)  # the head's tensor, not a copy

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.dtype != torch.int64 or not flat.is_contiguous():
            flat = flat.to(torch.int64).contiguous()
        out = torch.empty((flat.shape[0], self.embedding_dim), dtype=self.packed.dtype)  # [T, dim]
        if self.rows(self.packed.data_ptr(), self.num_embeddings, self.embedding_dim, flat.data_ptr(), flat.shape[0],
                     out.data_ptr(), torch.get_num_threads()) != 0:
            low, high = torch.aminmax(flat)
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got [{int(low)}, {int(high)}]")
        return out if ids.dim() == 1 else out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the tied head's packed weight"


def pack_linear_layers(model: nn.Module, rules: Mapping[torch.dtype, LinearRule]) -> int:
    """Replace the CPU ``nn.Linear`` modules of ``model`` as ``rules`` (``linear_choice.linear_rules``)
    say for their dtype: a ``NativeLinear`` where a native kernel runs (packed only where it takes
    every batch), a ``PackedLinear`` where oneDNN's packed matmul does, unchanged otherwise. An
    ``nn.Embedding`` tied to a packed-only head becomes a ``PanelEmbedding`` over its packed weight.
    Returns how many linears were replaced."""
    tied = _embeddings_by_weight(model)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            rule = rules.get(child.weight.dtype) if type(child) is nn.Linear else None
            if rule is None or child.weight.device.type != "cpu" or (rule.native is None and rule.kernel != "onednn"):
                continue
            embeddings = tied.get(id(child.weight), [])
            if rule.native is None:
                packed = PackedLinear(child)
            else:
                kernel = rule.native
                packed = NativeLinear(child, kernel, keep_weight=not kernel.packed_only
                                      or (bool(embeddings) and kernel.rows is None))
            setattr(parent, name, packed)
            count += 1
            if isinstance(packed, NativeLinear) and not packed.keeps_weight:
                for owner, attr in embeddings:
                    setattr(owner, attr, PanelEmbedding(packed))
    return count


def _embeddings_by_weight(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """(parent, attribute) of every plain CPU ``nn.Embedding``, by the id of its weight parameter."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Embedding and child.max_norm is None and child.weight.device.type == "cpu":
                found.setdefault(id(child.weight), []).append((parent, name))
    return found
