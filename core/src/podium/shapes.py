"""Named model shapes: real architectures' dimensions with random weights (benchmarks, device tests).

A shape is a transformers config with the published model's numbers (from its config.json on the
Hugging Face Hub); Podium builds the model and fills it with ``init_random_weights``. Throughput
and memory then match the real model's, while no weights are needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_LLAMA3_COMMON: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "dtype": "bfloat16",
}

NAMED_SHAPES: dict[str, dict[str, Any]] = {
    # the embedded default model's architecture (SmolLM2-135M-Instruct): with its tokenizer
    # (``--tokenizer DIR``, DIR from ``benchmarks/structured_cost.py --export-tokenizer DIR``) it serves
    # like the real model where its weights cannot travel (a device call's size limit)
    "smollm2-135m-shape": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2, "dtype": "bfloat16",
    },
    "llama-3.1-8b-shape": {
        **_LLAMA3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    # ~141 GB in bf16: more than one 80-141 GB device holds; tensor parallelism's reason to exist
    "llama-3.1-70b-shape": {
        **_LLAMA3_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "llama-3.2-1b-shape": {
        **_LLAMA3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "qwen3-0.6b-shape": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": "bfloat16",
    },
    "mixtral-8x7b-shape": {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    },
    "qwen3-30b-a3b-shape": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": "bfloat16",
    },
}


def shape_config(name_or_path: str | Path):
    """A transformers config for a named shape, or for a config.json file (or a folder holding one)."""
    from transformers import AutoConfig

    if str(name_or_path) in NAMED_SHAPES:
        fields = dict(NAMED_SHAPES[str(name_or_path)])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        return config
    path = Path(name_or_path)
    if path.is_dir() or path.suffix == ".json":
        from .loader.hf_folder import load_config

        if not (path / "config.json" if path.is_dir() else path).is_file():
            raise ValueError(f"{path}: no config.json there")
        return load_config(path)
    raise ValueError(f"unknown shape {str(name_or_path)!r}; named shapes: {', '.join(NAMED_SHAPES)}, or a config.json path")
