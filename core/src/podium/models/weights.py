"""Copying Hugging Face checkpoint tensors into a model whose parameters may merge several of them.

A checkpoint tensor lands in the parameter of the same name, or in a *piece* of a merged one. A
module declares its pieces in one of two ways:

- ``merged_shards = {hf_leaf: (param_leaf, start, size)}`` (merged projections):
  ``model.layers.3.self_attn.k_proj.weight`` lands in rows ``start : start + size`` of
  ``model.layers.3.self_attn.qkv_proj.weight`` (the same for ``.bias``);
- ``checkpoint_pieces() -> {relative_hf_name: (relative_param_name, index)}`` (stacked experts):
  ``index`` is ``(expert,)`` for a whole ``[expert]`` slice or ``(expert, start, size)`` for rows
  ``start : start + size`` of it, e.g. ``3.gate_proj.weight`` -> ``("gate_up_proj", (3, 0, I))``.

A merged parameter may also come whole under its own name (Phi-3's ``qkv_proj``, transformers 5's
stacked ``experts.gate_up_proj``). Every parameter must be filled completely (whole, or every
piece) and every checkpoint tensor must be used: anything else is an error that names the tensors.

A model transformed for tensor parallelism holds one rank's shard of some parameters and says
which slice of each checkpoint tensor it keeps in ``model.weight_slices`` ({checkpoint name: an
object with ``take(tensor)``, ``dim`` and ``size``}, ``parallel.sharding.Slices``). The loader
copies only that slice; a lazy tensor from the stream (``loader.lazy``) reads only it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

_SHOWN = 12  # names listed in an error message before "... and N more"

Piece = tuple[int, ...] | None  # None: the whole parameter


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _module_pieces(path: str, module: nn.Module, params: dict) -> dict[str, tuple[str, Piece]]:
    """{checkpoint name: (parameter name, piece)} that ``module`` (at ``path``) declares."""
    prefix = f"{path}." if path else ""
    pieces: dict[str, tuple[str, Piece]] = {}
    for hf_leaf, (target, start, size) in getattr(module, "merged_shards", {}).items():
        for leaf in ("weight", "bias"):
            if f"{prefix}{target}.{leaf}" in params:
                pieces[f"{prefix}{hf_leaf}.{leaf}"] = (f"{prefix}{target}.{leaf}", (start, size))
    declared = getattr(module, "checkpoint_pieces", None)
    if callable(declared):
        for hf_name, (target, index) in declared().items():
            pieces[prefix + hf_name] = (prefix + target, tuple(index))
    return pieces


def piece_of(param: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The view of ``param`` a piece names: whole, rows ``(start, size)``, ``(expert,)`` or ``(expert, start, size)``."""
    if piece is None:
        return param
    if len(piece) == 2:
        return param.narrow(0, piece[0], piece[1])
    expert = param[piece[0]]
    return expert if len(piece) == 1 else expert.narrow(0, piece[1], piece[2])


class WeightLoader:
    """Fills ``model``'s parameters from (hf_name, tensor) pairs; ``finish()`` checks completeness."""

    def __init__(self, model: nn.Module, ignore: Iterable[str] = ()) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.ignore = tuple(ignore)  # name suffixes to skip (rotary buffers, a tied lm_head)
        self.slices = getattr(model, "weight_slices", None) or {}  # tensor parallelism: this rank's slices
        self.pieces: dict[str, tuple[str, Piece]] = {}
        for path, module in model.named_modules():
            self.pieces.update(_module_pieces(path, module, self.params))
        self.expected: dict[str, dict[Piece, str]] = {name: {} for name in self.params}
        for hf_name, (name, piece) in self.pieces.items():
            self.expected[name][piece] = hf_name
        for name, pieces in self.expected.items():
            if not pieces:  # a plain parameter: one piece, the whole of it
                pieces[None] = name
        self.filled: dict[str, set] = {name: set() for name in self.params}
        self.unexpected: list[str] = []

    def load(self, hf_name: str, tensor: torch.Tensor) -> None:
        if hf_name.endswith(self.ignore):
            return
        name, piece = (hf_name, None) if hf_name in self.params else self.pieces.get(hf_name, (None, None))
        if name is None:
            self.unexpected.append(hf_name)
            return
        dest = piece_of(self.params[name].data, piece)
        rule = self.slices.get(hf_name)
        if rule is not None:
            tensor = rule.take(tensor)
            if dest.shape[rule.dim] > rule.size:  # the last rank's vocabulary shard: its tail stays padding
                dest = dest.narrow(rule.dim, 0, rule.size)
        elif hasattr(tensor, "load"):  # a lazy tensor, read whole
            tensor = tensor.load()
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, but the model expects {tuple(dest.shape)} "
                f"(parameter {name!r}); the checkpoint does not match its config.json"
            )
        dest.copy_(tensor)
        self.filled[name].add(piece)

    def _missing(self) -> list[str]:
        return [
            hf_name
            for name, pieces in self.expected.items()
            if None not in self.filled[name]  # loaded whole
            for piece, hf_name in pieces.items()
            if piece not in self.filled[name]
        ]

    def finish(self) -> None:
        """Raise ValueError naming unexpected checkpoint tensors or parameters left unfilled."""
        problems = []
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} unexpected weight(s) in the checkpoint: {_listing(self.unexpected)}")
        missing = self._missing()
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
