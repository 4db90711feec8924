"""oneDNN's packed matmul for CPU linear layers: weights reordered once at load into oneDNN's blocked
layout, for the dtypes and CPUs where no native kernel runs (linear_choice.py says which).

``F.linear`` on a bf16 CPU tensor hands oneDNN a plain [out, in] weight, which it reorders into
its blocked matmul layout on every call; packing once at load time removes that reorder, about a
third of a small-batch decode step's matmul time, with bit-identical results (the same kernel runs
on the same blocked weights). float32 linears packed for oneDNN beat ``F.linear`` (MKL's sgemm)
1.3-2.7x at 8-32 rows on an AVX2 CPU (equal at prefill sizes). Neither is bit-identical with the
other, and neither promises a row the same bits at every batch size (MKL's did not; torch 2.13's
oneDNN did at 1-256 rows, torch 2.8's did not).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; any row count works
PACKABLE = (torch.bfloat16, torch.float32)


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs ``dtype`` linears here (bf16 or fp32; see ``packing_unavailable``)."""
    return dtype in PACKABLE and not packing_unavailable(dtype)


@functools.cache
def packing_unavailable(dtype: torch.dtype = torch.bfloat16) -> str:
    """Why oneDNN cannot pack ``dtype`` linear weights in this process ("" when it can).

    Its bf16 matmul needs AVX512BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU (AMD Zen 3, say)
    ``_reorder_linear_weight`` raises, so one tiny weight is packed and used once to find out.
    """
    name = str(dtype).removeprefix("torch.")
    if dtype not in PACKABLE:
        return f"oneDNN linear packing is for {', '.join(str(d).removeprefix('torch.') for d in PACKABLE)}, not {name}"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch has no oneDNN linear ops"
    try:
        weight = torch.ones(32, 32, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        out = _linear_op()(torch.ones(2, 32, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as exc:
        return f"oneDNN cannot pack {name} weights on this CPU ({str(exc).splitlines()[0]})"
    if not bool((out == 32).all()):
        return f"oneDNN's packed {name} linear gave a wrong result on this CPU"
    return ""


@functools.cache
def _linear_op():
    """``torch.ops.mkldnn._linear_pointwise.default``, looked up once (not on every call)."""
    return torch.ops.mkldnn._linear_pointwise.default


class PackedLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` holding bf16 or fp32 weights: same parameters, oneDNN's matmul
    over weights packed once."""

    kernel_name = "onednn"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        dtype = linear.weight.dtype
        if dtype not in PACKABLE or linear.weight.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a bfloat16 or float32 CPU weight, got {dtype} on {linear.weight.device}")
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, dtype
        self.weight = linear.weight  # kept: state_dict, tied references and introspection see the usual parameter
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == self.dtype and x.is_contiguous():  # the model's [T, in] rows
            return _linear_op()(x, self.packed, self.bias, "none", [], "")  # [T, out]
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(self.dtype).contiguous()  # [N, in]
        out = _linear_op()(rows, self.packed, self.bias, "none", [], "")  # [N, out]
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed=onednn {str(self.dtype).removeprefix('torch.')}")
