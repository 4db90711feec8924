"""bfloat16 linear layers with weights pre-packed for oneDNN (AMX / AVX512-BF16 matmuls).

``F.linear`` on a bf16 CPU tensor hands oneDNN a plain [out, in] weight, which it reorders into
its blocked matmul layout on every call; packing once at load time removes that reorder, about a
third of a small-batch decode step's matmul time here, with bit-identical results (the same
kernel runs on the same blocked weights). float32 is left alone: MKL's packed sgemm only pays at
exactly the batch size it was packed for.

This is a transformation applied to a loaded model (``pack_linear_layers``); the model's modules
keep their names and parameters, so nothing else changes. Re-loading weights afterwards would leave
the packed copies stale: pack last.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; any row count works


def can_pack(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every bf16 CPU ``nn.Linear`` in ``model`` by a ``PackedLinear``; returns how many."""
    if not can_pack(torch.bfloat16):
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
