"""Shared helpers for model and loader tests: tiny random HF models and a flat-batch runner."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from podium.loader import resolve_model
from podium.models.registry import build_model
from podium_plugin_api import AttentionBackend, AttentionMetadata, ForwardContext, KVCacheSpec
from podium_plugin_api.ops import build_op_table

TINY = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
# prompts stay within original_max_position_embeddings: short factors (tests/test_rope.py decodes past it)
PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.5, 3.0, 6.0, 9.0],
                 "rope_theta": 10000.0, "partial_rotary_factor": 0.5}

# name -> (model_type, config overrides); each exercises one architecture feature
ARCHITECTURES = {
    "llama3-rope-untied": ("llama", {"rope_theta": 10000.0, "rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": False}),
    "llama2-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias-linear-rope": ("llama", {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1,
                                         "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral-sliding": ("mistral", {"sliding_window": 5, "tie_word_embeddings": False}),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": True, "use_sliding_window": False}),
    "qwen2-sliding-layers": ("qwen2", {"tie_word_embeddings": False, "use_sliding_window": True, "sliding_window": 6,
                                       "max_window_layers": 1}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    "mixtral-moe": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False,
                                "sliding_window": 7}),
    "qwen2-moe-shared": ("qwen2_moe", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                                       "shared_expert_intermediate_size": 56, "mlp_only_layers": [1],
                                       "norm_topk_prob": False, "tie_word_embeddings": False}),
    "qwen3-moe-top8": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 8, "moe_intermediate_size": 40,
                                     "norm_topk_prob": True, "head_dim": 32, "decoder_sparse_step": 2}),
    "gemma2-softcap": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 20, "sliding_window": 5,
                                  "attn_logit_softcapping": 2.0, "final_logit_softcapping": 1.5}),
    "gemma3-local-global": ("gemma3_text", {"head_dim": 16, "query_pre_attn_scalar": 20, "sliding_window": 5,
                                            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                            "rope_parameters": GEMMA3_ROPE}),
    "phi3-longrope-partial": ("phi3", {"pad_token_id": 0, "original_max_position_embeddings": 64, "sliding_window": 9,
                                       "rope_parameters": PHI3_LONGROPE}),
    "qwen2-yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 32}}),
}


@pytest.fixture(scope="module", autouse=False)
def single_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is several times faster on a shared, busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    config._attn_implementation = "eager"
    return config


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights around 1, biases nonzero) so no path hides behind init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)


def save_tiny_model(model_type: str, overrides: dict, folder: Path, seed: int = 0, **save_kwargs):
    """A random transformers model saved with save_pretrained (safetensors) to ``folder``; returns it."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder, **save_kwargs)
    return model


def load_podium(model: str, dtype: torch.dtype = torch.float32):
    source = resolve_model(str(model))
    podium_model = build_model(source.hf_config, build_op_table(), dtype, "cpu")
    podium_model.load_weights(source.weights())
    return source, podium_model


class FlatBatchRunner:
    """Runs a Podium model over ragged sequences in flat batches with a paged KV cache (test harness)."""

    def __init__(self, model, config, block_size: int, backend: AttentionBackend | None = None, num_blocks: int = 64):
        self.model, self.block_size = model, block_size
        self.backend = backend or AttentionBackend()
        heads = config.num_attention_heads
        spec = KVCacheSpec(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_size=getattr(config, "head_dim", None) or config.hidden_size // heads,
            block_size=block_size,
            dtype=torch.float32,
        )
        shape = self.backend.kv_cache_shape(spec, num_blocks)
        self.kv_caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
        # blocks handed out in a scrambled order so a table mix-up cannot pass by accident
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist())
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Process ``chunks`` (sequence id -> new token ids) in one flat batch -> logits per sequence."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.computed.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            self.computed[seq] = end
        meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, self.block_size)
        ctx = ForwardContext(self.backend.prepare_metadata(meta), self.kv_caches, self.backend)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
            logits = self.model.compute_logits(hidden)
        out, offset = {}, 0
        for seq, length in zip(chunks, query_lens):
            out[seq] = logits[offset : offset + length]
            offset += length
        return out


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


# --------------------------------------------------------------------------- writing GGUF files
def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: HF rotate-half rows -> interleaved pairs (written independently here)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path, arch: str, metadata: dict, tensors: list[tuple[str, np.ndarray, int | None]]) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for name, data, raw_dtype in tensors:
        writer.add_tensor(name, data, raw_dtype=None if raw_dtype is None else gguf.GGMLQuantizationType(raw_dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_arch(arch: str):
    import gguf

    return {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
            "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
            "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}[arch]


def _gguf_tensors(hf_model, arch: str) -> list[tuple[str, np.ndarray, None]]:
    """The model's tensors as llama.cpp's converter writes them: gguf-py's name map, Q/K interleaved
    for llama, experts stacked per projection, Gemma norms as 1 + weight, vector shared-expert gates."""
    import gguf

    config = hf_model.config
    names = gguf.get_tensor_name_map(_gguf_arch(arch), config.num_hidden_layers)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors = []
    for name, value in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = value.float().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> ffn_gate_exps, ffn_up_exps [E, I, H]
            prefix = names.get_name(name.replace("gate_up_proj", "down_proj")).replace("down_exps", "{}_exps")
            half = value.shape[1] // 2
            tensors += [(prefix.format("gate") + ".weight", value[:, :half]), (prefix.format("up") + ".weight", value[:, half:])]
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {name}")
        if not name.endswith((".weight", ".bias")):  # transformers 5's stacked experts: a bare parameter
            gguf_name += ".weight"
        part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
        if arch == "llama" and part in heads:
            value = llama_cpp_permute(value, heads[part])
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            value = value + 1
        if part == "ffn_gate_inp_shexp":
            value = value.reshape(-1)
        tensors.append((gguf_name, value))
    return [(name, np.ascontiguousarray(value), None) for name, value in tensors]


def _gguf_metadata(config, arch: str) -> dict:
    """llama.cpp's metadata for ``config``, including each architecture's own keys."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    meta = {"block_count": config.num_hidden_layers, "context_length": config.max_position_embeddings,
            "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
            "attention.head_count": config.num_attention_heads, "attention.head_count_kv": config.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps), "rope.freq_base": float(rope["rope_theta"]),
            "attention.key_length": head_dim, "vocab_size": config.vocab_size}
    if rope.get("rope_type") == "linear":
        meta.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])})
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        meta.update({"expert_count": experts, "expert_used_count": config.num_experts_per_tok})
    if arch in ("qwen2moe", "qwen3moe"):
        meta["expert_feed_forward_length"] = config.moe_intermediate_size
    if arch == "qwen2moe":
        meta["expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    if arch in ("gemma2", "gemma3"):
        meta["attention.sliding_window"] = config.sliding_window
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, key, None):
                meta[key] = float(getattr(config, key))
    if arch == "gemma3":
        meta["rope.freq_base_swa"] = float(config.rope_parameters["sliding_attention"]["rope_theta"])
        meta["attention.sliding_window_pattern"] = config.layer_types.index("full_attention") + 1
    if arch == "phi3":
        del meta["attention.key_length"]
        meta["rope.dimension_count"] = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        meta["rope.scaling.original_context_length"] = config.original_max_position_embeddings
        if config.sliding_window:
            meta["attention.sliding_window"] = config.sliding_window
    return {f"{arch}.{key}": value for key, value in meta.items()}


def export_gguf(hf_model, arch: str, path, extra: list | tuple = ()) -> None:
    """Write a transformers model as an all-F32 GGUF the way llama.cpp's converter lays it out."""
    extra = list(extra)
    rope = hf_model.config.rope_parameters
    if rope.get("rope_type") == "longrope":  # Phi-3: the factors are tensors
        extra += [("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32), None),
                  ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32), None)]
    write_gguf(path, arch, _gguf_metadata(hf_model.config, arch), _gguf_tensors(hf_model, arch) + extra)


def teacher_forced_gaps(hf_model, prompts: list[list[int]], outs) -> torch.Tensor:
    """|Podium's logprob - ``hf_model``'s logprob| of each token Podium generated (``outs``: the
    CompletionOutputs, with ``logprobs``), the reference teacher-forced on Podium's tokens."""
    gaps = []
    with torch.inference_mode():
        for ids, out in zip(prompts, outs):
            mine = list(out.token_ids)
            logits = hf_model(torch.tensor([ids + mine])).logits[0, len(ids) - 1:-1]
            theirs = torch.log_softmax(logits.float(), -1)[torch.arange(len(mine)), torch.tensor(mine)]
            gaps.append((theirs - torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, mine)])).abs())
    return torch.cat(gaps)
