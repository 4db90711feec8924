"""bfloat16 linear layers with weights pre-packed at load: the native AMX kernel, else oneDNN's.

``F.linear`` on a bf16 CPU tensor hands oneDNN a plain [out, in] weight, which it reorders into
its blocked matmul layout on every call; packing once at load time removes that reorder, about a
third of a small-batch decode step's matmul time here, with bit-identical results (the same
kernel runs on the same blocked weights). float32 is left alone: MKL's packed sgemm only pays at
exactly the batch size it was packed for.

Where the CPU has AMX, ``AmxLinear`` goes further for the rows of a decode step (up to
``AMX_MAX_ROWS``): the native kernel (native/amx_linear.c) streams its tiled weights once per 32
rows with ~20 us less fixed cost per call than oneDNN's packed path, whose per-call setup and
weight stream took a decode step's linears to half this machine's read bandwidth. Each row's
result is independent of the other rows (batch invariance); larger batches (prefill chunks) go to
oneDNN through ``F.linear``, whose per-call reorder is small next to their matmul.

This is a transformation applied to a loaded model (``pack_linear_layers``); the model's modules
keep their names and parameters, so nothing else changes. Re-loading weights afterwards would leave
the packed copies stale: pack last.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; any row count works
AMX_MAX_ROWS = 256  # AmxLinear's kernel up to this many rows, oneDNN above (measured alike at 256-512)


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs ``dtype`` linears here (bf16 only; see ``packing_unavailable``)."""
    return dtype == torch.bfloat16 and not packing_unavailable()


@functools.cache
def packing_unavailable() -> str:
    """Why oneDNN cannot pack bf16 linear weights in this process ("" when it can).

    Its bf16 matmul needs AVX512BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU (AMD Zen 3, say)
    ``_reorder_linear_weight`` raises, so one tiny weight is packed and used once to find out.
    """
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch has no oneDNN linear ops"
    try:
        weight = torch.ones(32, 32, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        out = _linear_op()(torch.ones(2, 32, dtype=torch.bfloat16), packed, None, "none", [], "")
    except RuntimeError as exc:
        return f"oneDNN cannot pack bf16 weights on this CPU ({str(exc).splitlines()[0]})"
    if not bool((out == 32).all()):
        return "oneDNN's packed bf16 linear gave a wrong result on this CPU"
    return ""


@functools.cache
def _linear_op():
    """``torch.ops.mkldnn._linear_pointwise.default``, looked up once (not on every call)."""
    return torch.ops.mkldnn._linear_pointwise.default


class PackedLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` holding bf16 weights: same parameters, packed matmul."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a bfloat16 CPU weight, got {linear.weight.dtype} on {linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept: state_dict, tied references and introspection see the usual parameter
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous():  # the model's [T, in] rows
            return _linear_op()(x, self.packed, self.bias, "none", [], "")  # [T, out]
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [N, in]
        out = _linear_op()(rows, self.packed, self.bias, "none", [], "")  # [N, out]
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=onednn"


def amx_tiles(weight: torch.Tensor, pack=None) -> torch.Tensor:
    """weight [N, K] bf16 -> the AMX kernel's layout [N/16, K/32, 16, 16, 2], zero padded to N % 32 == 0
    and K % 32 == 0: tiles of 16 outputs x 32 inputs, inputs k and k+1 of an output side by side.
    ``pack`` (``NativeKernels.amx_pack[torch.bfloat16]``) writes it in one parallel pass; without
    it torch pads and permutes (the definition the native packer is tested against)."""
    n, k = weight.shape
    n_pad, k_pad = n + -n % 32, k + -k % 32
    if pack is not None:
        source = weight.detach().contiguous()
        tiles = torch.empty(n_pad // 16, k_pad // 32, 16, 16, 2, dtype=torch.bfloat16)
        pack(source.data_ptr(), n, k, tiles.data_ptr(), torch.get_num_threads())
        return tiles
    padded = F.pad(weight.detach(), (0, k_pad - k, 0, n_pad - n))  # [Np, Kp]
    return padded.view(n_pad // 16, 16, k_pad // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


class AmxLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` holding bf16 weights: same parameters, the native AMX kernel."""

    def __init__(self, linear: nn.Linear, kernel, pack=None) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise ValueError(f"AmxLinear needs a bfloat16 CPU weight, got {linear.weight.dtype} on {linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept: larger batches, state_dict, tied references see the usual parameter
        self.bias = linear.bias
        self.tiles = amx_tiles(linear.weight, pack)
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x  # [M, in]
        m = rows.shape[0]
        if m > AMX_MAX_ROWS or m == 0 or rows.dtype != torch.bfloat16 or rows.stride(-1) != 1:
            return F.linear(x, self.weight, self.bias)
        if rows.shape[1] != self.in_features:
            raise ValueError(f"input has {rows.shape[1]} features; this layer takes {self.in_features}")
        out = torch.empty((m, self.out_features), dtype=torch.bfloat16)  # [M, out]
        bias = None if self.bias_f32 is None else self.bias_f32.data_ptr()
        rc = self.kernel(rows.data_ptr(), rows.stride(0), m, self.tiles.data_ptr(), self.out_features,
                         self.in_features, bias, out.data_ptr(), self.out_features, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("the AMX linear kernel could not allocate its padded rows")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=amx"


def pack_linear_layers(model: nn.Module, amx_kernel=None, amx_pack=None) -> int:
    """Replace every bf16 CPU ``nn.Linear`` in ``model`` by an ``AmxLinear`` (given the native kernel,
    ``NativeKernels.amx_linear[torch.bfloat16]``, and its packer, ``amx_pack``) or a ``PackedLinear``;
    returns how many."""
    if amx_kernel is None and not can_pack(torch.bfloat16):
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
                setattr(parent, name, AmxLinear(child, amx_kernel, amx_pack) if amx_kernel is not None
                        else PackedLinear(child))
                count += 1
    return count
