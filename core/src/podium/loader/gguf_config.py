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
window), or MixtralForCausalLM when they have experts; ``qwen2`` and ``qwen3`` map to theirs.

The later architectures (``qwen2moe``, ``qwen3moe``, ``gemma2``, ``gemma3``, ``phi3``, Mixtral) take
their config from transformers' own class (``AutoConfig.for_model``): their many fields are not
worth a copy, and the embedded default model (Llama) keeps the fast path. Their extra metadata
(``arch_kwargs``) follows llama.cpp's converter: expert counts and sizes, soft-capping, sliding
windows (Gemma 3: a pattern of 6 and a local rope base of 10k unless the file says otherwise), the
attention scale (Gemma's ``query_pre_attn_scalar``: the head size, or hidden / heads for the 27B
models, llama.cpp's rule) and Phi-3's rotary size, original context and longrope factors (tensors).
"""

from __future__ import annotations

from typing import Any

from .gguf_reader import GGUFFile
from .gguf_weights import ROPE_FREQS, dequantize

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# transformers' model_type of each (llama files with experts: "mixtral")
MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope: config, not weights
# layer counts of the Gemma models whose attention scale is hidden / heads (llama.cpp's 27B rule)
GEMMA_HIDDEN_SCALED = {"gemma2": 46, "gemma3": 62}

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
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        for key, name in (("rope.scaling.original_context_length", "original_max_position_embeddings"),
                          ("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if f"{arch}.{key}" in meta:
                scaling[name] = meta[f"{arch}.{key}"]
        return scaling
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear, yarn, rope_freqs)")


def _optional(meta: dict, arch: str, keys: dict[str, str]) -> dict[str, Any]:
    return {name: meta[f"{arch}.{key}"] for key, name in keys.items() if f"{arch}.{key}" in meta}


def _moe_kwargs(meta: dict, arch: str) -> dict[str, Any]:
    """Qwen-MoE: every layer sparse; top-k renormalised by default for qwen3moe only (llama.cpp's)."""
    kwargs = _optional(meta, arch, {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                                    "expert_feed_forward_length": "moe_intermediate_size",
                                    "expert_shared_feed_forward_length": "shared_expert_intermediate_size"})
    kwargs["norm_topk_prob"] = bool(meta.get(f"{arch}.expert_weights_norm", arch == "qwen3moe"))
    kwargs.update(decoder_sparse_step=1, mlp_only_layers=[])
    return kwargs


def _gemma_kwargs(meta: dict, arch: str, kwargs: dict) -> dict[str, Any]:
    extra = _optional(meta, arch, {"attention.sliding_window": "sliding_window",
                                   "attn_logit_softcapping": "attn_logit_softcapping",
                                   "final_logit_softcapping": "final_logit_softcapping"})
    hidden_scaled = kwargs["num_hidden_layers"] == GEMMA_HIDDEN_SCALED[arch]
    head_dim = kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    extra["query_pre_attn_scalar"] = kwargs["hidden_size"] // kwargs["num_attention_heads"] if hidden_scaled else head_dim
    if arch == "gemma3":
        extra["sliding_window_pattern"] = int(meta.get(f"{arch}.attention.sliding_window_pattern", 6))
        extra["rope_local_base_freq"] = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        extra.setdefault("final_logit_softcapping", None)
        extra.setdefault("attn_logit_softcapping", None)
    return extra


def _phi3_kwargs(gguf: GGUFFile, meta: dict, kwargs: dict) -> dict[str, Any]:
    """Rotary size (``rope.dimension_count`` is the rotated part of a head) and longrope from its tensors."""
    head_dim = meta.get("phi3.attention.key_length") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    extra: dict[str, Any] = {"head_dim": int(head_dim)}
    extra.update(_optional(meta, "phi3", {"attention.sliding_window": "sliding_window",
                                          "rope.scaling.original_context_length": "original_max_position_embeddings"}))
    rotary = meta.get("phi3.rope.dimension_count")
    if rotary and int(rotary) != int(head_dim):
        extra["partial_rotary_factor"] = int(rotary) / int(head_dim)
    if all(name in gguf.tensors for name in ROPE_FACTORS):
        long, short = (dequantize(gguf, gguf.tensors[name]).float().tolist() for name in ROPE_FACTORS)
        scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
        if "phi3.rope.scaling.attn_factor" in meta:
            scaling["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
        extra["rope_scaling"] = scaling
    return extra


def arch_kwargs(gguf: GGUFFile, arch: str, kwargs: dict) -> tuple[str, dict[str, Any]]:
    """(model_type, the later architectures' extra config kwargs) from the file's metadata."""
    meta = gguf.metadata
    if arch == "llama" and meta.get("llama.expert_count"):
        experts = _optional(meta, arch, {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"})
        return "mixtral", {**experts, "architectures": ["MixtralForCausalLM"]}
    if arch in ("qwen2moe", "qwen3moe"):
        return MODEL_TYPES[arch], _moe_kwargs(meta, arch)
    if arch in GEMMA_HIDDEN_SCALED:
        return MODEL_TYPES.get(arch, arch), _gemma_kwargs(meta, arch, kwargs)
    if arch == "phi3":
        return arch, _phi3_kwargs(gguf, meta, kwargs)
    return arch, {}


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
    if head_dim and arch != "phi3":  # Phi-3's dimension_count is the rotated part (arch_kwargs)
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
    model_type, extra = arch_kwargs(gguf, arch, kwargs)
    return model_type, {**kwargs, **extra}


def config_from_kwargs(model_type: str, kwargs: dict[str, Any]):
    """What ``AutoConfig.for_model(model_type, **kwargs)`` holds, for the kwargs above (that itself for
    the later architectures: module docstring)."""
    if model_type not in _DEFAULTS:
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, **kwargs)
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
