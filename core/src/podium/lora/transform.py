"""LoRA as a transformation of the plain model: its projections become ``LoRALinear`` (the model code
never learns about adapters), and adapters are prepared for, and written into, their slots.

``apply_lora`` runs once the model is built, loaded, sharded and prepared by the platform, so it
wraps whatever each projection has become (packed, quantized, the platform's GEMV linear):

    attention   qkv_proj (slices q, k, v; or the whole, for adapters of a merged qkv_proj), o_proj
    MLP         gate_up_proj (slices gate, up; or the whole), down_proj

With tensor parallelism the model carries ``weight_slices`` (``parallel.sharding``): the rows or
columns of each checkpoint tensor this rank keeps. An adapter is sliced the same way: a column-
parallel projection's slices (dim 0) cut lora_B's rows, a row-parallel one's (dim 1) lora_A's
columns; the row-parallel partial sums then join the base output's in the layer's all-reduce
(``ReducedOutput``/``ReducedMlp`` wrap the layer, so the ``LoRALinear`` sits inside them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.layers import Attention, GatedMLP
from ..parallel.layers import ReducedOutput
from .layers import LoRALinear, LoRAState
from .peft_folder import AdapterError, PeftAdapter

TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Target:
    """Where one PEFT module's delta goes: a ``LoRALinear`` and its slice (None: the whole projection)."""

    layer: LoRALinear
    index: int | None
    checkpoint_name: str  # the base weight's checkpoint name, whose tensor-parallel slices the delta takes


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter as this rank writes it: per target, A [r, K_rank] and B [N_rank, r] scaled, in the model dtype."""

    name: str
    parts: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]  # (PEFT module path, A, B)
    rank: int


class LoRAModel:
    """The model's adapted projections by PEFT module path, and their shared ``LoRAState``."""

    def __init__(self, targets: dict[str, Target], layers: list[LoRALinear], state: LoRAState, max_rank: int,
                 weight_slices: dict, dtype: torch.dtype) -> None:
        self.targets, self.layers, self.state = targets, layers, state
        self.max_rank, self.weight_slices, self.dtype = max_rank, weight_slices, dtype

    def prepare(self, adapter: PeftAdapter, name: str) -> PreparedAdapter:
        """``adapter`` checked against the model and this rank's slices; AdapterError naming what does not fit."""
        if adapter.rank > self.max_rank:
            raise AdapterError(f"LoRA adapter {name!r} ({adapter.path}) has rank {adapter.rank}, above this engine's "
                               f"max_lora_rank of {self.max_rank}; start the engine with max_lora_rank >= "
                               f"{adapter.rank} (--max-lora-rank {adapter.rank})")
        unknown = sorted(path for path in adapter.modules if path not in self.targets)
        if unknown:
            shown = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
            raise AdapterError(f"LoRA adapter {name!r} ({adapter.path}) adapts {shown}, which this model cannot adapt; "
                               f"adapters may target {', '.join(TARGET_NAMES)} of the decoder layers")
        parts = []
        for path, delta in sorted(adapter.modules.items()):
            target = self.targets[path]
            lora_a, lora_b = self._slice(target, delta.lora_a, delta.lora_b)
            self._check_shapes(name, path, target, lora_a, lora_b)
            parts.append((path, lora_a.to(self.dtype).contiguous(), (lora_b * delta.scale).to(self.dtype).contiguous()))
        return PreparedAdapter(name, tuple(parts), adapter.rank)

    def _slice(self, target: Target, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slices = self.weight_slices.get(target.checkpoint_name)
        if slices is None:
            return lora_a, lora_b
        if slices.dim == 0:  # column-parallel: this rank's output rows
            return lora_a, slices.take(lora_b)
        return slices.take(lora_a), lora_b  # row-parallel: this rank's input columns

    @staticmethod
    def _check_shapes(name: str, path: str, target: Target, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        layer = target.layer
        out = layer.out_features if target.index is None else layer.slices[target.index]
        if lora_a.shape[1] != layer.in_features or lora_b.shape[0] != out:
            raise AdapterError(f"LoRA adapter {name!r}: {path} has lora_A {list(lora_a.shape)} and lora_B "
                               f"{list(lora_b.shape)}, but the model's projection takes {layer.in_features} inputs "
                               f"and gives {out} outputs here; was it trained for another base model?")

    def write(self, slot: int, adapter: PreparedAdapter) -> None:
        """Put ``adapter`` into slot ``slot`` of every adapted projection (projections it leaves alone: zero)."""
        for layer in self.layers:
            layer.clear_slot(slot)
        for path, lora_a, lora_b in adapter.parts:
            target = self.targets[path]
            if target.index is None:  # a merged projection adapted whole: B over every output row
                target.layer.lora_a[slot, :lora_a.shape[0]].copy_(lora_a, non_blocking=True)
                target.layer.lora_b[slot, :, :lora_a.shape[0]].copy_(lora_b, non_blocking=True)
            else:
                target.layer.write_slice(slot, target.index, lora_a, lora_b)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear_slot(slot)


def apply_lora(model: nn.Module, hidden_size: int, num_slots: int, max_rank: int, dtype: torch.dtype,
               device: torch.device, ops: dict) -> LoRAModel:
    """Wrap the model's adaptable projections (module docstring); returns their ``LoRAModel``."""
    state = LoRAState(num_slots, device)
    targets: dict[str, Target] = {}
    layers: list[LoRALinear] = []

    def wrap(parent: nn.Module, attr: str, prefix: str, in_features: int, parts: dict[str, int]) -> None:
        merged = f"{prefix}{attr}"
        holder, base = parent, getattr(parent, attr)
        if isinstance(base, ReducedOutput):  # tensor parallelism: adapt inside the all-reduce
            holder, attr, base = base, "inner", base.inner
        layer = LoRALinear(base, in_features, tuple(parts.values()), num_slots, max_rank, dtype, device, state, ops)
        setattr(holder, attr, layer)
        layers.append(layer)
        if len(parts) > 1:
            targets[merged] = Target(layer, None, f"{merged}.weight")
        for index, name in enumerate(parts):
            targets[f"{prefix}{name}"] = Target(layer, index if len(parts) > 1 else None, f"{prefix}{name}.weight")

    hidden = hidden_size  # (every adapted projection reads or writes the residual stream)
    for path, module in list(model.named_modules()):
        prefix = _checkpoint_path(path)
        if isinstance(module, Attention):
            q_size, kv_size = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
            wrap(module, "qkv_proj", prefix, hidden, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size})
            wrap(module, "o_proj", prefix, q_size, {"o_proj": hidden})
        elif isinstance(module, GatedMLP):
            inter = module.merged_shards["gate_proj"][2]  # this rank's share, under tensor parallelism
            wrap(module, "gate_up_proj", prefix, hidden, {"gate_proj": inter, "up_proj": inter})
            wrap(module, "down_proj", prefix, inter, {"down_proj": hidden})
    if not layers:
        raise ValueError(f"enable_lora: {type(model).__name__} has no projections LoRA adapters can target "
                         f"({', '.join(TARGET_NAMES)}); start the engine without enable_lora")
    return LoRAModel(targets, layers, state, max_rank, getattr(model, "weight_slices", {}), dtype)


def _checkpoint_path(path: str) -> str:
    """A module's path as the checkpoint (and PEFT) names it: the collectives' ``inner`` wrappers left
    out (``model.layers.0.mlp.inner`` -> ``model.layers.0.mlp.``)."""
    parts = [part for part in path.split(".") if part != "inner"] if path else []
    return ".".join(parts) + "." if parts else ""

