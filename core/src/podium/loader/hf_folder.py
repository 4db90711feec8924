"""A Hugging Face model folder as a ModelSource.

Reads ``config.json`` (transformers' own config classes; ``trust_remote_code`` is never set, so no
code from the folder runs), the weights (``model.safetensors``, sharded ``*.safetensors`` with
``model.safetensors.index.json``, or ``pytorch_model*.bin`` read with ``weights_only=True``),
the tokenizer when the folder has one, and ``generation_config.json`` for eos ids and
sampling defaults. Tensors are streamed one at a time, never all held at once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..models.rotary import scaled_context_length
from .source import ModelSource, WeightStream, config_dtype, generation_defaults, read_generation_config, token_id_list

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def max_model_len(config) -> int:
    """The context length a config allows (rope scaling included)."""
    return scaled_context_length(config)


def load_config(path: Path):
    """A transformers config from a folder holding config.json, or from a config.json file."""
    from transformers import AutoConfig

    file = path / "config.json" if path.is_dir() else path
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read model config {file}: {error}") from None
    if not model_type:
        raise ValueError(f"{file} has no model_type; it is not a transformers model config")
    try:
        return AutoConfig.from_pretrained(str(file), trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        raise ValueError(f"{file}: transformers cannot build a config for model_type {model_type!r} ({error})") from None


def weight_files(folder: Path) -> tuple[list[Path], str]:
    """(files, format) of a folder's weights: safetensors preferred, then PyTorch .bin."""
    for index_name, fmt in (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "bin")):
        index = folder / index_name
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [name for name in shards if not (folder / name).exists()]
            if missing:
                raise ValueError(f"{index} lists shard(s) missing from the folder: {', '.join(missing)}")
            return [folder / name for name in shards], fmt
    for pattern, fmt in (("*.safetensors", "safetensors"), ("pytorch_model*.bin", "bin")):
        files = sorted(folder.glob(pattern))
        if files:
            return files, fmt
    raise ValueError(f"{folder} has a config.json but no weights (*.safetensors or pytorch_model*.bin)")


def stream_weights(files: list[Path], fmt: str, lazy: bool = False) -> WeightStream:
    """(name, tensor) pairs from each file in turn; ``lazy``: safetensors tensors as ``LazyTensor``
    (a tensor-parallel rank reads only its slices)."""
    if fmt == "safetensors":
        from safetensors import safe_open

        from .lazy import safetensors_lazy

        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, (safetensors_lazy(handle, name) if lazy else handle.get_tensor(name))
        return
    import torch

    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None when it has no tokenizer files."""
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)


def load_folder(folder: Path, tokenizer: Any | None = None) -> ModelSource:
    """``folder`` as a ModelSource; ``tokenizer`` replaces the folder's own if given."""
    config = load_config(folder)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict() if hasattr(quantization, "to_dict") else None
    if quantization is not None and not quantization.get("quant_method"):
        raise ValueError(f"{folder}/config.json has a quantization_config without quant_method; cannot tell its format")
    files, fmt = weight_files(folder)
    generation = read_generation_config(folder)
    started = time.perf_counter()
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(folder)
    tokenizer_seconds = time.perf_counter() - started
    eos = token_id_list(generation.get("eos_token_id"), getattr(config, "eos_token_id", None))
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    architectures = ", ".join(getattr(config, "architectures", None) or [config.model_type])
    return ModelSource(
        hf_config=config,
        tokenizer=tokenizer,
        weight_stream=lambda lazy=False: stream_weights(files, fmt, lazy),
        generation_defaults=generation_defaults(generation),
        eos_token_ids=eos,
        max_model_len=max_model_len(config),
        description=f"Hugging Face folder {folder} ({architectures}, {len(files)} {fmt} file(s))",
        dtype=config_dtype(config),
        path=str(folder),
        load_seconds={"tokenizer": tokenizer_seconds},
        quantization=quantization or None,
    )
