"""Walking a model's linear layers with the checkpoint names that fill them (merged projections too).

A quantization method decides per layer from what the checkpoint stores for it; a merged
projection (``qkv_proj``) is filled by several checkpoint tensors (its parent's ``merged_shards``,
``podium.models.weights``), and a tied LM head by the embedding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LinearSite:
    """One ``nn.Linear`` of a model: where it hangs and which checkpoint weights fill it, in row order."""

    parent: nn.Module
    leaf: str  # the attribute name on ``parent``
    path: str  # the module's full name ("model.layers.0.self_attn.qkv_proj")
    linear: nn.Linear
    shards: tuple[tuple[str, int, int], ...]  # (checkpoint weight name, first row, rows)


def linear_sites(model: nn.Module) -> Iterator[LinearSite]:
    """Every plain ``nn.Linear`` of ``model`` (the ones a transformation has not replaced yet)."""
    for parent_path, parent in list(model.named_modules()):
        prefix = f"{parent_path}." if parent_path else ""
        merged = getattr(parent, "merged_shards", {})
        for leaf, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            shards = tuple(sorted(((f"{prefix}{hf}.weight", start, size)
                                   for hf, (target, start, size) in merged.items() if target == leaf),
                                  key=lambda shard: shard[1]))
            if not shards:
                shards = ((f"{prefix}{leaf}.weight", 0, child.out_features),)
            yield LinearSite(parent, leaf, prefix + leaf, child, shards)


def tied_head(model: nn.Module) -> bool:
    """Whether the model's LM head is its embedding (``lm_head.weight`` is not in the checkpoint)."""
    return bool(getattr(model, "tie_word_embeddings", False))


class ConcatLinear(nn.Module):
    """A merged projection made of separately stored parts: their outputs side by side."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self._parts = tuple(parts)  # held by the parent under their checkpoint names, not registered twice
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self._parts], dim=-1)


def replace_linear(site: LinearSite, make: Callable[[int], nn.Module]) -> None:
    """Put ``make(out_features)`` in place of ``site``'s linear; a merged projection gets one per checkpoint
    tensor instead, hung on the parent under the checkpoint's name (``q_proj``: so each loads its own
    tensors, scales included, by name), and a ``ConcatLinear`` of them in the merged one's place."""
    if len(site.shards) == 1 and site.shards[0][0] == f"{site.path}.weight":
        setattr(site.parent, site.leaf, make(site.linear.out_features))
        return
    parts = []
    for name, _, size in site.shards:
        part = make(size)
        setattr(site.parent, name.rsplit(".", 2)[-2], part)  # "...self_attn.q_proj.weight" -> "q_proj"
        parts.append(part)
    site.parent.merged_shards = {hf: spec for hf, spec in site.parent.merged_shards.items() if spec[0] != site.leaf}
    setattr(site.parent, site.leaf, ConcatLinear(parts))
