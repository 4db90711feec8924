"""INT4 weight-only checkpoints, AWQ and GPTQ (act-order too), group size 128.

Layouts (``podium_plugin_api.int4``): 4-bit weights eight to an int32, a zero point and a scale per
group of ``group_size`` input rows; AWQ's gemm layout (qweight [K, N/8]) and GPTQ's v1 layout
(qweight [K/8, N], ``g_idx`` for act-order / desc_act).

Checkpoints keep q/k/v and gate/up separate (their packed output dimension is not the first), so a
merged projection becomes one ``Int4Linear`` per checkpoint tensor, hung on the parent under the
checkpoint's name (``self_attn.q_proj``), and ``ConcatLinear`` in the merged one's place
(``replace.replace_linear``). The matmul is the op table's ``int4_linear``: the contract's pure-torch
reference (dequantize, then multiply in float32), or a platform's kernel (CUDA: a Triton
dequant-GEMM) where it overrides it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from podium_plugin_api.int4 import dequantize, int4_linear, quantize_awq
from podium_plugin_api.quantization import QuantizationMethod

from .replace import linear_sites, replace_linear


class Int4Linear(nn.Module):
    """x [..., K] -> [..., N] from an AWQ or GPTQ packed weight (module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int, fmt: str,
                 dtype: torch.dtype = torch.float32, ops: Mapping[str, Callable] | None = None) -> None:
        super().__init__()
        if in_features % group_size or out_features % 8 or in_features % 8:
            raise ValueError(f"an INT4 {fmt} layer of {in_features} -> {out_features} does not split into groups of "
                             f"{group_size} inputs and int32s of 8")
        self.in_features, self.out_features, self.group_size, self.format = in_features, out_features, group_size, fmt
        groups = in_features // group_size

        def packed(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=torch.int32), requires_grad=False)

        if fmt == "awq":
            self.qweight = packed(in_features, out_features // 8)
        else:
            self.qweight = packed(in_features // 8, out_features)
            self.g_idx = packed(in_features)
        self.qzeros = packed(groups, out_features // 8)
        self.scales = nn.Parameter(torch.empty(groups, out_features), requires_grad=False)  # float32: fp16's values exactly
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.int4_linear = (ops or {"int4_linear": int4_linear})["int4_linear"]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [K, N] (x @ it is the layer)."""
        return dequantize(self.qweight, self.qzeros, self.scales, getattr(self, "g_idx", None), self.group_size,
                          self.format).to(dtype)

    quantized_op = "int4_linear"  # (podium_plugin_api.quantization: a platform may fuse the op before it)

    def quantized_args(self) -> tuple:
        return (self.qweight, self.qzeros, self.scales, getattr(self, "g_idx", None), self.group_size, self.format,
                self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        out = self.int4_linear(rows, self.qweight, self.qzeros, self.scales, getattr(self, "g_idx", None),
                               self.group_size, self.format, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format} g{self.group_size}"


ONLINE_GROUP = 128  # the group size of online quantization (what AWQ checkpoints use)


class _Int4Method(QuantizationMethod):
    fmt = ""

    def __init__(self, config: Mapping, online: bool = False) -> None:
        super().__init__(config, online)
        bits, group = self.config.get("bits", self.config.get("w_bit")), self.config.get("group_size",
                                                                                           self.config.get("q_group_size"))
        if bits != 4:
            raise ValueError(f"{self.name} checkpoints with {bits}-bit weights are not supported; Podium reads 4-bit")
        if not isinstance(group, int) or group <= 0:
            raise ValueError(f"{self.name} group_size {group} is not supported; Podium reads positive group sizes "
                             "(128 is what it is tested with)")
        self.group_size = group
        self.skipped = tuple(self.config.get("modules_to_not_convert") or ())

    def apply(self, model: nn.Module, ops: Mapping[str, Callable]) -> None:
        for site in linear_sites(model):
            if site.path == "lm_head" or any(s in site.path for s in self.skipped):
                continue
            linear = site.linear
            replace_linear(site, lambda rows, linear=linear: Int4Linear(
                linear.in_features, rows, linear.bias is not None, self.group_size, self.fmt, linear.weight.dtype, ops))

    def describe(self) -> str:
        return f"{self.name} int4 g{self.group_size}"


class AWQMethod(_Int4Method):
    """AutoAWQ gemm checkpoints, and online ``quantization="awq"`` of a float model: each decoder linear
    rounded to nearest into AWQ's layout in groups of 128 at ``finish`` (no activation-aware scaling:
    for serving a float checkpoint at INT4 speed, and for benchmarks without an AWQ checkpoint)."""

    name = "awq"
    checkpoint_names = ("awq",)
    fmt = "awq"
    supports_online = True

    def __init__(self, config: Mapping, online: bool = False) -> None:
        if online:
            config = {"bits": 4, "group_size": ONLINE_GROUP, **config}
        super().__init__(config, online)
        if str(self.config.get("version", "gemm")).lower() != "gemm" or not self.config.get("zero_point", True):
            raise ValueError("AWQ checkpoints other than version gemm with zero points are not supported")
        self.ops: Mapping[str, Callable] = {}

    def apply(self, model: nn.Module, ops: Mapping[str, Callable]) -> None:
        self.ops = ops
        if not self.online:
            super().apply(model, ops)

    def finish(self, model: nn.Module) -> None:
        if not self.online:
            return
        for site in linear_sites(model):
            linear = site.linear
            if site.path == "lm_head" or linear.in_features % self.group_size or linear.out_features % 8:
                continue
            layer = Int4Linear(linear.in_features, linear.out_features, linear.bias is not None, self.group_size,
                               "awq", linear.weight.dtype, self.ops).to(linear.weight.device)
            for name, tensor in quantize_awq(linear.weight.data, self.group_size).items():
                getattr(layer, name).data = tensor
            if linear.bias is not None:
                layer.bias = linear.bias
            setattr(site.parent, site.leaf, layer)

    def describe(self) -> str:
        return f"awq int4 g{self.group_size}" + (" (online, round to nearest)" if self.online else "")


class GPTQMethod(_Int4Method):
    name = "gptq"
    checkpoint_names = ("gptq",)
    fmt = "gptq"

    def __init__(self, config: Mapping, online: bool = False) -> None:
        super().__init__(config, online)
        if str(self.config.get("checkpoint_format", "gptq")) != "gptq":
            raise ValueError(f"GPTQ checkpoint_format {self.config.get('checkpoint_format')!r} is not supported; "
                             "Podium reads the gptq (v1) format")
