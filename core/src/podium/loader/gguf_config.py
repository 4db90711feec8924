"""A GGUF file's model config from its metadata, without transformers' config classes.

The fields are the ones transformers' config class holds for the same metadata (``LlamaConfig``,
``Qwen2Config``, ``Qwen3Config``): its defaults for keys the file lacks and the values its
``__post_init__`` derives (``head_dim``, ``num_key_value_heads``, ``layer_types``,
``rope_parameters``). Building ``LlamaConfig`` itself imports its type validators, which import
``torch.distributed.tensor`` and sympy: ~1.4 s of a 5 s start on a 2-core CPU, for an object the
engine only reads attributes from. ``tests/test_gguf_config.py`` compares every field with
``AutoConfig.for_model``, so a transformers release that changes a default fails there.

The metadata keys are the ones transformers' GGUF support reads. ``llama``-architecture files
become LlamaForCausalLM (Mistral GGUFs included: llama.cpp runs them as Llama, without a sliding
window); ``qwen2`` and ``qwen3`` map to theirs.
"""

from __future__ import annotations

from typing import Any

from .gguf_reader import GGUFFile
from .gguf_weights import ROPE_FREQS, dequantize

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

DEFAULT_ROPE_THETA = 10000.0

# transformers' fields and defaults per model type (5.x). None for head_dim / num_key_value_heads:
# derived from the head count (Llama). Qwen's sliding window is off unless use_sliding_window,
# which no GGUF key sets, so it is None; its num_key_value_heads default is 32, not the head count.
_COMMON = {"hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
           "tie_word_embeddings": False, "attention_dropout": 0.0}
_QWEN = {**_COMMON, "vocab_size": 151936, "max_position_embeddings": 32768, "num_key_value_heads": 32,
         "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
         "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "vocab_size": 32000, "max_position_embeddings": 2048, "num_key_value_heads": None,
              "head_dim": None, "pretraining_tp": 1, "attention_bias": False, "mlp_bias": False,
              "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
}


class GGUFConfig:
    """Model fields as attributes (``config.hidden_size``), as a transformers config holds them.

    ``rope_freq_factors`` is set when the file has llama.cpp's ``rope_freqs`` tensor.
    """

    def __init__(self, model_type: str, **fields: Any) -> None:
        self.model_type = model_type
        vars(self).update(fields)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in vars(self).items() if name != "layer_types")
        return f"GGUFConfig({fields})"


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
    """(model_type, config keyword arguments) from the file's metadata: what ``AutoConfig.for_model`` takes."""
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


def config_from_kwargs(model_type: str, kwargs: dict[str, Any]) -> GGUFConfig:
    """What ``AutoConfig.for_model(model_type, **kwargs)`` holds, for the kwargs above."""
    fields = {**_DEFAULTS[model_type], **kwargs}
    scaling, theta = fields.pop("rope_scaling", None), fields.pop("rope_theta", DEFAULT_ROPE_THETA)
    fields["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if "head_dim" in fields and fields["head_dim"] is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if "max_window_layers" in fields:  # Qwen: one layer type per layer, all full attention (no window)
        fields["layer_types"] = ["full_attention"] * fields["num_hidden_layers"]
    return GGUFConfig(model_type, **fields)


def gguf_config(gguf: GGUFFile) -> GGUFConfig:
    """The model config for the file (``rope_freq_factors`` set when it has ``rope_freqs``)."""
    config = config_from_kwargs(*gguf_config_kwargs(gguf))
    if ROPE_FREQS in gguf.tensors:
        config.rope_freq_factors = dequantize(gguf, gguf.tensors[ROPE_FREQS]).float().tolist()
    return config
