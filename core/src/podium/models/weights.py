"""Copying Hugging Face checkpoint tensors into a model whose projections may be merged.

A module that merges projections declares ``merged_shards = {hf_leaf: (param_leaf, start, size)}``:
``model.layers.3.self_attn.k_proj.weight`` then lands in rows ``start : start + size`` of
``model.layers.3.self_attn.qkv_proj.weight`` (and the same for ``.bias``). Every other name is
copied into the parameter of the same name. Every parameter must be filled completely, and every
checkpoint tensor must be used: anything else is an error that names the tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

_SHOWN = 12  # names listed in an error message before "... and N more"


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


class WeightLoader:
    """Fills ``model``'s parameters from (hf_name, tensor) pairs; ``finish()`` checks completeness."""

    def __init__(self, model: nn.Module, ignore: Iterable[str] = ()) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.ignore = tuple(ignore)  # name suffixes to skip (rotary buffers, a tied lm_head)
        self.expected = {name: self._row_ranges(name) for name in self.params}
        self.filled: dict[str, set] = {name: set() for name in self.params}
        self.unexpected: list[str] = []

    def _row_ranges(self, name: str) -> dict:
        """The pieces a parameter is made of, by row range (None: whole), with their checkpoint names."""
        module_path, _, param_leaf = name.rpartition(".")
        owner_path, _, leaf = module_path.rpartition(".")
        owner = self.model.get_submodule(owner_path) if owner_path else self.model
        shards = getattr(owner, "merged_shards", {})
        pieces = {
            (start, size): f"{owner_path}.{hf_leaf}.{param_leaf}"
            for hf_leaf, (target, start, size) in shards.items()
            if target == leaf
        }
        return pieces or {None: name}

    def _target(self, hf_name: str) -> tuple[str, tuple[int, int] | None]:
        """(parameter name, row range or None) for one checkpoint name; KeyError if it has none."""
        if hf_name in self.params:
            return hf_name, None
        module_path, _, param_leaf = hf_name.rpartition(".")
        owner_path, _, leaf = module_path.rpartition(".")
        try:
            owner = self.model.get_submodule(owner_path)
        except AttributeError:
            raise KeyError(hf_name) from None
        shard = getattr(owner, "merged_shards", {}).get(leaf)
        if shard is None:
            raise KeyError(hf_name)
        target, start, size = shard
        name = f"{owner_path}.{target}.{param_leaf}"
        if name not in self.params:
            raise KeyError(hf_name)
        return name, (start, size)

    def load(self, hf_name: str, tensor: torch.Tensor) -> None:
        if hf_name.endswith(self.ignore):
            return
        try:
            name, rows = self._target(hf_name)
        except KeyError:
            self.unexpected.append(hf_name)
            return
        param = self.params[name]
        dest = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, but the model expects {tuple(dest.shape)} "
                f"(parameter {name!r}); the checkpoint does not match its config.json"
            )
        dest.copy_(tensor)
        self.filled[name].add(rows)

    def finish(self) -> None:
        """Raise ValueError naming unexpected checkpoint tensors or parameters left unfilled."""
        problems = []
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} unexpected weight(s) in the checkpoint: {_listing(self.unexpected)}")
        missing = [
            hf_name
            for name, pieces in self.expected.items()
            for rows, hf_name in pieces.items()
            if rows not in self.filled[name]
        ]
        if missing:
            problems.append(f"{len(missing)} parameter(s) missing from the checkpoint: {_listing(missing)}")
        if problems:
            kind = type(self.model).__name__
            raise ValueError(f"cannot load weights into {kind}: " + "; ".join(problems))


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], ignore: Iterable[str] = ()) -> None:
    """Copy every (hf_name, tensor) into ``model`` (see the module docstring), then check completeness."""
    loader = WeightLoader(model, ignore)
    with torch.no_grad():
        for hf_name, tensor in weights:
            loader.load(hf_name, tensor)
    loader.finish()
