"""FP8 W8A8: float8_e4m3 weights with float32 scales, activations quantized per token at run time.

Weight scales come in three granularities (what checkpoints store next to ``weight``)::

    per-tensor   weight_scale []  or [1]          w = q * s
    per-channel  weight_scale [N, 1]              w[n, :] = q[n, :] * s[n]
    block        weight_scale(_inv) [N/128, K/128] w[n, k] = q[n, k] * s[n // 128, k // 128]  (DeepSeek, Qwen3-FP8)

Checkpoints: ``quant_method: "fp8"`` (transformers' fine-grained FP8: ``weight_block_size`` and
``weight_scale_inv``) and ``compressed-tensors`` float8 schemes (``weight_scale``; strategy tensor,
channel or block; dynamic per-token activations). Their q/k/v and gate/up carry their own scales,
so merged projections become one layer per checkpoint tensor (``replace.replace_linear``).
``quantization="fp8"`` on a float checkpoint quantizes each linear at load with a per-channel scale
(``finish``).

Activations (dynamic, per token): ``s_x[t] = max|x[t]| / 448``, ``x_q = fp8(x / s_x)``; the
product of the two quantized operands is summed in float32 and scaled back by ``s_x[t] * s_w``.
The op is the table's ``fp8_linear``: the contract's pure-torch reference (``podium_plugin_api.fp8``),
a platform's kernel where it overrides it (CUDA: ``torch._scaled_mm``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from podium_plugin_api.fp8 import FP8, FP8_MAX
from podium_plugin_api.quantization import QuantizationMethod

from .replace import linear_sites, replace_linear


class Fp8Linear(nn.Module):
    """x [..., K] -> [..., N] with ``weight`` fp8 [N, K] and ``weight_scale`` float32 (granularity above).

    ``scale_name``: the checkpoint's name of the scale tensor (``weight_scale`` or ``weight_scale_inv``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, granularity: str,
                 ops: Mapping[str, Callable], scale_name: str = "weight_scale",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features, self.granularity = in_features, out_features, granularity
        shapes = {"tensor": (1,), "channel": (out_features, 1),
                  "block": (-(-out_features // 128), -(-in_features // 128))}
        if granularity not in shapes:
            raise ValueError(f"fp8 weight scales are per tensor, channel or block; got {granularity!r}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.scale_name = scale_name
        self.register_parameter(scale_name, nn.Parameter(torch.empty(shapes[granularity], dtype=torch.float32),
                                                         requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.fp8_linear = ops["fp8_linear"]

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.scale_name)

    quantized_op = "fp8_linear"  # (podium_plugin_api.quantization: a platform may fuse the op before it)

    def quantized_args(self) -> tuple:
        return self.weight, self.scale, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self.fp8_linear(rows, self.weight, self.scale, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scales={self.granularity}"


def quantize_weight(weight: torch.Tensor, granularity: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (fp8 [N, K], float32 scale): per channel (the online method's) or per tensor."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if granularity == "channel" else w.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / (scale if granularity == "channel" else scale.reshape(1, 1))).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Method(QuantizationMethod):
    """``quant_method: "fp8"`` checkpoints (transformers' fine-grained FP8: ``weight_block_size`` [128, 128]
    and ``weight_scale_inv``; without it one ``weight_scale`` per tensor), and online quantization of a
    float model (``quantization="fp8"``: per-channel scales at ``finish``)."""

    name = "fp8"
    checkpoint_names = ("fp8",)
    supports_online = True

    def __init__(self, config: Mapping, online: bool = False) -> None:
        super().__init__(config, online)
        self.ops: Mapping[str, Callable] = {}
        self.skipped = tuple(self.config.get("modules_to_not_convert") or ())
        if online:
            self.granularity, self.scale_name = "channel", "weight_scale"
            return
        if self.config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("fp8 checkpoints with static activation scales are not supported; Podium quantizes "
                             "activations per token at run time (activation_scheme: dynamic)")
        block = self.config.get("weight_block_size")
        if block is not None and list(block) != [128, 128]:
            raise ValueError(f"fp8 weight_block_size {block} is not supported; Podium reads 128 x 128 blocks")
        self.granularity = "block" if block else "tensor"
        self.scale_name = "weight_scale_inv" if block else "weight_scale"

    def _skip(self, path: str) -> bool:
        return path == "lm_head" or any(s and (path == s or path.endswith("." + s)) for s in self.skipped)

    def apply(self, model: nn.Module, ops: Mapping[str, Callable]) -> None:
        """A checkpoint's layers swapped in on the meta model; online, nothing yet (``finish`` quantizes)."""
        self.ops = ops
        if self.online:
            return
        for site in linear_sites(model):
            if not self._skip(site.path):
                linear = site.linear
                replace_linear(site, lambda rows, linear=linear: Fp8Linear(
                    linear.in_features, rows, linear.bias is not None, self.granularity, ops, self.scale_name,
                    linear.weight.dtype))

    def finish(self, model: nn.Module) -> None:
        if not self.online:
            return
        for site in linear_sites(model):
            if self._skip(site.path):
                continue
            linear = site.linear
            layer = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, "channel",
                              self.ops).to(linear.weight.device)
            q, scale = quantize_weight(linear.weight.data, "channel")
            layer.weight.data, layer.weight_scale.data = q, scale
            if linear.bias is not None:
                layer.bias = linear.bias
            setattr(site.parent, site.leaf, layer)

    def describe(self) -> str:
        how = "online, per-channel" if self.online else self.granularity
        return f"fp8 W8A8 ({how} weight scales, per-token activations)"


class CompressedTensorsMethod(Fp8Method):
    """compressed-tensors checkpoints with a float8 scheme: ``weight_scale`` per tensor, channel or block."""

    name = "compressed-tensors"
    checkpoint_names = ("compressed-tensors",)
    supports_online = False

    def __init__(self, config: Mapping, online: bool = False) -> None:
        QuantizationMethod.__init__(self, config, online)
        self.ops = {}
        groups = list((self.config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors: Podium reads one config group; this checkpoint has {len(groups)}")
        weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors weights {weights} are not supported; Podium reads float8 (FP8 W8A8)")
        if inputs and not inputs.get("dynamic", False):
            raise ValueError("compressed-tensors with static input scales is not supported; Podium quantizes "
                             "activations per token at run time")
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported (tensor, channel, block)")
        if strategy == "block" and list(weights.get("block_structure") or [128, 128]) != [128, 128]:
            raise ValueError(f"compressed-tensors block_structure {weights.get('block_structure')} is not "
                             "supported; Podium reads 128 x 128 blocks")
        self.granularity, self.scale_name = strategy, "weight_scale"
        self.skipped = tuple(s.removeprefix("re:").strip(".*") for s in (self.config.get("ignore") or ()))
