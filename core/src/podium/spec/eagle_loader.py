"""Loading an EAGLE-1 / EAGLE-3 head from its checkpoint folder, checked against the target.

A folder holds ``config.json`` (a Llama config of the head: hidden size, heads, rope; EAGLE-3 adds
``draft_vocab_size`` and may name ``eagle_aux_hidden_state_layer_ids``) and the weights
(``*.safetensors``, or ``pytorch_model.bin``), keys with or without a ``model.`` prefix (see
``eagle_head`` for the layouts). The target must be a decoder stack (``model.layers``) whose hidden
size the head's ``fc`` reads; EAGLE-3 reads three of its layers' inputs (by default 2, L // 2 and
L - 3 of its L layers, as vLLM picks them), kept by forward pre-hooks on those layers (``LayerInputs``)
only while this proposer runs.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ..models.weights import load_hf_weights
from .draft_device import DraftDevice, with_layers
from .eagle_head import EagleHead

_DROPPED = ("t2d",)  # EAGLE-3's target -> draft mask: only training needs it


class LayerInputs:
    """Keeps the input (hidden + residual) of chosen decoder layers in every forward of the target;
    called with the target's last hidden states it returns them side by side [T, 3H]."""

    def __init__(self, layers: nn.ModuleList, ids: tuple[int, ...]) -> None:
        self.kept: list[torch.Tensor | None] = [None] * len(ids)
        for slot, index in enumerate(ids):
            layers[index].register_forward_pre_hook(partial(self._keep, slot))

    def _keep(self, slot: int, module, args) -> None:
        hidden, residual = args[0], args[1]
        self.kept[slot] = hidden if residual is None else hidden + residual

    def __call__(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.kept, dim=-1)


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            weights.update(load_file(str(file)))
    elif (folder / "pytorch_model.bin").exists():
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"speculative_config model {str(folder)!r} has no weights (*.safetensors or pytorch_model.bin)")
    return {name.removeprefix("model."): tensor for name, tensor in weights.items()}


def head_config(folder: Path):
    from transformers import LlamaConfig

    if not (folder / "config.json").is_file():
        raise ValueError(f"speculative_config model {str(folder)!r}: an EAGLE head is a folder with config.json and "
                         "its weights")
    return LlamaConfig(**json.loads((folder / "config.json").read_text()))


def aux_layer_ids(config, num_layers: int) -> tuple[int, ...]:
    """The three target layers whose inputs EAGLE-3 reads: the checkpoint's, else vLLM's default."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"EAGLE-3 reads three target layers' hidden states; layers {ids} do not fit the target's "
                         f"{num_layers} layers (set eagle_aux_hidden_state_layer_ids in the head's config.json)")
    return ids


def check_head(config, weights: dict, target_config, eagle3: bool, name: str) -> None:
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    fc = weights.get("fc.weight")
    width = (3 if eagle3 else 2) * hidden
    kind = "EAGLE-3" if eagle3 else "EAGLE-1"
    if fc is None or tuple(fc.shape) != (config.hidden_size, width):
        got = "no fc.weight" if fc is None else f"fc.weight {tuple(fc.shape)}"
        raise ValueError(f"speculative_config model {name!r} is not an {kind} head for this target (hidden size "
                         f"{hidden}): {kind} reads fc.weight [{config.hidden_size}, {width}], the checkpoint has {got}"
                         + ("; an EAGLE-1 head is method 'eagle'" if eagle3 and fc is not None and
                            fc.shape[1] == 2 * hidden else "")
                         + ("; an EAGLE-3 head is method 'eagle3'" if not eagle3 and fc is not None and
                            fc.shape[1] == 3 * hidden else ""))
    if config.vocab_size != vocab:
        raise ValueError(f"speculative_config model {name!r} has vocab_size {config.vocab_size}, the target {vocab}; "
                         "an EAGLE head must be trained for this target's vocabulary")
    if eagle3 and config.num_hidden_layers != 1:
        raise ValueError(f"speculative_config model {name!r}: an EAGLE-3 head has one decoder layer (midlayer), "
                         f"its config says num_hidden_layers={config.num_hidden_layers}")


def load_eagle_head(spec, shard, max_tokens: int) -> DraftDevice:
    """The head on the shard's device, with its cache spec and what the target keeps for it."""
    folder, eagle3 = Path(spec.model), spec.method == "eagle3"
    config, weights = head_config(folder), read_checkpoint(folder)
    target, target_config = shard.model, shard.source.hf_config
    if not isinstance(getattr(getattr(target, "model", None), "layers", None), nn.ModuleList):
        raise ValueError(f"speculative_config method {spec.method!r}: the target model ({type(target).__name__}) "
                         "exposes no decoder layers (model.layers) to read hidden states from")
    if eagle3 and not any(k.startswith("midlayer.") for k in weights):  # some EAGLE-3 exports say layers.0
        weights = {"midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k: v
                   for k, v in weights.items()}
    check_head(config, weights, target_config, eagle3, spec.model)
    d2t = weights.pop("d2t", None)
    for key in _DROPPED + (() if eagle3 else ("lm_head.weight",)):
        weights.pop(key, None)
    with torch.device("meta"):
        head = EagleHead(config, shard.ops, eagle3, target_config.hidden_size, max_tokens,
                         fc_bias="fc.bias" in weights, own_embedding="embed_tokens.weight" in weights,
                         own_lm_head="lm_head.weight" in weights).to(dtype=shard.dtype)
    head._apply(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=shard.device))
    for module in head.modules():  # rotary caches, as build_model does
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    load_hf_weights(head, weights.items(), ignore=["rotary_emb.inv_freq"])
    if eagle3:
        head.set_vocab_map(d2t)
    head.borrow(target)
    head = shard.platform.prepare_model(head.eval())
    keep = LayerInputs(target.model.layers, aux_layer_ids(config, len(target.model.layers))) if eagle3 else \
        (lambda last_hidden: last_hidden)
    cache_config = with_layers(config, 1 if eagle3 else config.num_hidden_layers)
    label = f"{'EAGLE-3' if eagle3 else 'EAGLE-1'} head {folder.name}"
    device = DraftDevice(head, cache_config, shard.kv_cache_dtype, shard, label)
    device.target_keep = keep
    return device
