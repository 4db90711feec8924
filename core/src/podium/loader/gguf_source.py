"""A ``.gguf`` file as a ModelSource: config from its metadata, tokenizer through transformers.

The config is built here from the metadata (the same keys transformers' GGUF support reads),
because transformers' own path re-parses every metadata array with ``gguf.GGUFReader`` (~5 s for
a 49k vocabulary). ``llama``-architecture files become LlamaForCausalLM (Mistral GGUFs included:
llama.cpp runs them as Llama, without a sliding window); ``qwen2`` and ``qwen3`` map to theirs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .gguf_reader import GGUFFile, read_gguf
from .gguf_weights import ROPE_FREQS, dequantize, gguf_weights
from .hf_folder import max_model_len
from .source import ModelSource, token_id_list

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# metadata key (after "<arch>.") -> config field
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
_TOKEN_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}


def _single(value: Any, key: str) -> Any:
    """Per-layer arrays (some files store head counts per layer) must be uniform here."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF metadata {key} varies per layer ({value}); Podium needs one value")
        return value[0]
    return value


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear, rope_freqs)")


def gguf_config_kwargs(gguf: GGUFFile) -> tuple[str, dict]:
    """(model_type, config keyword arguments) from the file's metadata."""
    arch, meta = gguf.architecture, gguf.metadata
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    kwargs: dict[str, Any] = {}
    for key, name in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in meta:
            kwargs[name] = _single(meta[f"{arch}.{key}"], key)
    missing = sorted({"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"} - set(kwargs))
    if missing:
        raise ValueError(f"GGUF file {gguf.path} lacks metadata for {', '.join(missing)}")
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    if head_dim:
        kwargs["head_dim"] = int(head_dim)
    tokens = meta.get("tokenizer.ggml.tokens")
    kwargs["vocab_size"] = meta.get(f"{arch}.vocab_size") or (tokens if isinstance(tokens, int) else len(tokens or []))
    kwargs["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    for name, key in _TOKEN_KEYS.items():
        if f"tokenizer.ggml.{key}" in meta:
            kwargs[name] = meta[f"tokenizer.ggml.{key}"]
    scaling = _rope_scaling(meta, arch)
    if scaling:
        kwargs["rope_scaling"] = scaling
    kwargs["architectures"] = [GGUF_ARCHITECTURES[arch]]
    return arch, kwargs


def gguf_config(gguf: GGUFFile):
    """A transformers config for the file (``rope_freq_factors`` set when it has ``rope_freqs``)."""
    from transformers import AutoConfig

    model_type, kwargs = gguf_config_kwargs(gguf)
    config = AutoConfig.for_model(model_type, **kwargs)
    if ROPE_FREQS in gguf.tensors:
        config.rope_freq_factors = dequantize(gguf, gguf.tensors[ROPE_FREQS]).float().tolist()
    return config


def gguf_tokenizer(path: Path):
    """transformers' tokenizer for a GGUF file (its own GGUF conversion; no code from the folder)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def load_gguf(path: Path, tokenizer: Any | None = None, description: str | None = None) -> ModelSource:
    """``path`` (a .gguf file) as a ModelSource; ``tokenizer`` replaces the file's own if given.

    A file without tokenizer metadata gets no tokenizer (None), like a folder without tokenizer files.
    """
    gguf = read_gguf(path)
    config = gguf_config(gguf)
    meta = gguf.metadata
    eos = token_id_list(*(meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    started = time.perf_counter()
    if tokenizer is None and "tokenizer.ggml.model" in meta:
        tokenizer = gguf_tokenizer(path)
    tokenizer_seconds = time.perf_counter() - started

    def stream():
        return gguf_weights(read_gguf(path), heads, kv_heads)

    return ModelSource(
        hf_config=config,
        tokenizer=tokenizer,
        weight_stream=stream,
        eos_token_ids=eos,
        max_model_len=max_model_len(config),
        description=description or f"GGUF file {path} ({gguf.architecture}, {len(gguf.tensors)} tensors)",
        path=str(path),
        load_seconds={"tokenizer": tokenizer_seconds},
    )
