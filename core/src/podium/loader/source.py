"""What a model argument resolves to: config, tokenizer, a weight stream and generation defaults."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WeightStream = Iterator[tuple[str, torch.Tensor]]
# keep: checkpoint names to hand over as stored (a GGUF tensor's block bytes) instead of dequantized
StreamFactory = Callable[..., WeightStream]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# generation_config.json keys -> SamplingParams fields (what vLLM also takes from it)
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass
class ModelSource:
    """A resolved model.

    ``weights()`` streams (Hugging Face name, tensor) pairs, read lazily from disk, or returns
    None for a shape model (random weights). ``dtype`` is the model's own preference (its config's
    torch_dtype; float32 for GGUF), which ``dtype="auto"`` may use.
    """

    hf_config: Any  # a transformers PretrainedConfig; for a GGUF file a GGUFConfig with the same fields
    tokenizer: Any | None  # a transformers tokenizer; None for a shape model without one
    weight_stream: StreamFactory | None  # called as weight_stream(keep=frozenset of names)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: list[int] = field(default_factory=list)
    max_model_len: int = 0
    description: str = ""
    dtype: torch.dtype = torch.float32
    path: str | None = None  # the folder or file loaded from; None for a named shape
    load_seconds: dict[str, float] = field(default_factory=dict)  # e.g. {"tokenizer": 0.4}: startup stages
    # what the checkpoint says of its quantization: config.json's quantization_config, or for a GGUF
    # file {"quant_method": "gguf", "tensor_types": {name: ggml type id}}; None: float weights
    quantization: dict[str, Any] | None = None

    def weights(self, lazy: bool = False, keep: frozenset[str] = frozenset()) -> WeightStream | None:
        """The weight stream; ``lazy``: tensors as ``loader.lazy.LazyTensor`` where the format allows
        (read by slice; tensor parallelism asks for it), plain tensors otherwise; names in ``keep``
        come as stored (GGUF block bytes), not dequantized."""
        if self.weight_stream is None:
            return None
        kwargs: dict[str, Any] = {"keep": keep} if keep else {}
        if lazy and _takes_lazy(self.weight_stream):
            kwargs["lazy"] = True
        return self.weight_stream(**kwargs)

    @property
    def has_weights(self) -> bool:
        return self.weight_stream is not None


def _takes_lazy(stream: Callable) -> bool:
    import inspect

    try:
        return "lazy" in inspect.signature(stream).parameters
    except (TypeError, ValueError):
        return False


def resolve_dtype(name: str | torch.dtype, preferred: torch.dtype) -> torch.dtype:
    """"auto" -> ``preferred`` (the model's or the platform's choice); else the named dtype."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {name}")
        return name
    if name == "auto":
        return preferred
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def config_dtype(config, fallback: torch.dtype = torch.float32) -> torch.dtype:
    """The config's declared torch dtype (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    value = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    if isinstance(value, str):
        value = DTYPES.get(value.replace("torch.", ""))
    return value if value in DTYPES.values() else fallback


def generation_defaults(generation_config: dict) -> dict[str, Any]:
    """Sampling defaults a model's generation_config.json sets, as SamplingParams field names."""
    return {ours: generation_config[theirs] for theirs, ours in _GENERATION_KEYS.items()
            if generation_config.get(theirs) is not None}


def read_generation_config(folder: Path) -> dict[str, Any]:
    """A folder's generation_config.json as a dict ({} when there is none)."""
    file = folder / "generation_config.json"
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"cannot read {file}: {error}") from None


def sampling_defaults(setting: str, source: ModelSource) -> dict[str, Any]:
    """The sampling defaults ``EngineConfig.generation_config`` asks for: the model's own ("auto"),
    none ("vllm", "none"), or those of the generation_config.json in the folder ``setting``."""
    if setting == "auto":
        return dict(source.generation_defaults)
    if setting in ("vllm", "none"):
        return {}
    folder = Path(setting).expanduser()
    if not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config={setting!r}: not auto, vllm or none, and not a folder holding "
                         "generation_config.json")
    return generation_defaults(read_generation_config(folder))


def token_id_list(*values: int | Iterable[int] | None) -> list[int]:
    """Ids from ints, lists and Nones, in first-seen order without repeats."""
    ids: list[int] = []
    for value in values:
        for item in [value] if isinstance(value, int) else (value or []):
            if int(item) not in ids:
                ids.append(int(item))
    return ids
