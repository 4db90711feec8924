"""A LoRA adapter from a PEFT folder (what ``PeftModel.save_pretrained`` writes).

    adapter_config.json         peft_type LORA, r, lora_alpha, use_rslora, rank_pattern, alpha_pattern, ...
    adapter_model.safetensors   base_model.model.<module path>.lora_A.weight [r, K], .lora_B.weight [N, r]
                                (adapter_model.bin, a torch pickle, where no safetensors file is)

Each adapted module's delta is ``scale * B (A x)``, ``scale = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA), ``r`` and ``alpha`` the module's own where ``rank_pattern`` / ``alpha_pattern`` name it (PEFT's
matching: a key matches a module whose dotted path ends with it). What the engine cannot serve is
refused here, naming the setting: DoRA, trained biases, ``modules_to_save``, activated LoRA, ...
Which modules the model can adapt is the model's question (``transform``), asked by the caller.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidParameter

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight")
# settings whose non-default value changes what the adapter computes in ways not served here
_REFUSED = {
    "use_dora": "DoRA (use_dora) adapters",
    "lora_bias": "adapters with a trained lora_B bias (lora_bias)",
    "modules_to_save": "adapters that replace whole modules (modules_to_save)",
    "layer_replication": "adapters with layer_replication",
    "trainable_token_indices": "adapters that train token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "target_parameters": "adapters on raw parameters (target_parameters)",
    "use_qalora": "QA-LoRA adapters (use_qalora)",
}


class AdapterError(InvalidParameter):
    """An adapter folder that cannot be served: the message names the folder, the problem and the fix."""

    def __init__(self, message: str, param: str | None = "lora_path") -> None:
        super().__init__(message, param)


@dataclass(frozen=True)
class ModuleDelta:
    """One adapted module: A [r, K], B [N, r] (float32, as stored), its scale."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    """A folder's adapter: module path (``model.layers.0.self_attn.q_proj``) -> its delta."""

    path: str
    modules: dict[str, ModuleDelta]

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def read_adapter(path: str | Path) -> PeftAdapter:
    """The adapter in folder ``path``; AdapterError naming what is missing or not served."""
    folder = Path(path)
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        match = _KEY.fullmatch(name)
        if match is None:
            raise AdapterError(f"LoRA adapter {folder}: tensor {key!r} is not a LoRA A/B weight (embedding "
                               f"adapters and extra saved modules are not served)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    modules = {module: _delta(folder, module, pair, config) for module, pair in pairs.items()}
    if not modules:
        raise AdapterError(f"LoRA adapter {folder}: its weight file holds no lora_A/lora_B tensors")
    return PeftAdapter(str(folder), modules)


def _read_config(folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"LoRA adapter {folder}: no {CONFIG_FILE} there; give the folder PEFT's save_pretrained "
                           f"wrote")
    try:
        config = json.loads(file.read_text())
    except ValueError as exc:
        raise AdapterError(f"LoRA adapter {folder}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"LoRA adapter {folder}: peft_type is {kind}; only LORA adapters are served")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise AdapterError(f"LoRA adapter {folder}: {what} are not served ({key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {folder}: adapters with trained biases are not served (bias="
                           f"{config['bias']!r}); train with bias='none'")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    raise AdapterError(f"LoRA adapter {folder}: no {' or '.join(WEIGHT_FILES)} there")


def _delta(folder: Path, module: str, pair: dict[str, torch.Tensor], config: dict) -> ModuleDelta:
    if set(pair) != {"A", "B"}:
        missing = "lora_B" if "A" in pair else "lora_A"
        raise AdapterError(f"LoRA adapter {folder}: module {module} has no {missing} weight")
    lora_a, lora_b = pair["A"].float(), pair["B"].float()
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_b.shape[1] != lora_a.shape[0]:
        raise AdapterError(f"LoRA adapter {folder}: module {module} has lora_A {list(lora_a.shape)} and lora_B "
                           f"{list(lora_b.shape)}; expected [r, in] and [out, r]")
    rank = lora_a.shape[0]
    alpha = float(_pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return ModuleDelta(lora_a, lora_b, scale)


def _pattern(patterns: dict, module: str, default):
    """PEFT's per-module override: the first key matching the end of the module's dotted path."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({key})", module):
            return value
    return default
