"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE.

Each is the Llama-family stack with ``moe.SparseMoeBlock`` as the MLP of its sparse layers:

    Mixtral    every layer sparse; top-k renormalised; Llama attention (sliding window if configured);
               checkpoint names ``block_sparse_moe.experts.N.w1/w3/w2`` (gate/up/down) read as ``mlp.*``
    Qwen2-MoE  sparse where ``(i + 1) % decoder_sparse_step == 0`` and i not in ``mlp_only_layers``
               (dense ``intermediate_size`` MLP elsewhere); renormalised if ``norm_topk_prob``; a shared
               expert (``shared_expert_intermediate_size``) with a sigmoid gate; bias on q/k/v (``qkv_bias``)
    Qwen3-MoE  the same layer rule, no shared expert; Qwen3 attention (q/k RMSNorm)
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .layers import GatedMLP, Ops
from .llama import LlamaForCausalLM, Qwen3ForCausalLM
from .moe import SparseMoeBlock

_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.(experts\.\d+\.)?")
_MIXTRAL_LEAVES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def mixtral_name(name: str) -> str:
    """Mixtral's original checkpoint names -> the ``mlp.*`` names (``experts.N.w1`` -> ``experts.N.gate_proj``)."""
    match = _MIXTRAL_EXPERT.search(name)
    if match is None:
        return name
    rest = name[match.end():]
    if match.group(1):
        leaf, _, tail = rest.partition(".")
        rest = f"{_MIXTRAL_LEAVES.get(leaf, leaf)}.{tail}"
    return f"{name[:match.start()]}.mlp.{match.group(1) or ''}{rest}"


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config) -> dict:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}

    @staticmethod
    def build_mlp(config, layer_index: int, ops: Ops) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, ops, num_experts=config.num_local_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.intermediate_size,
                              renormalize=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((mixtral_name(name), tensor) for name, tensor in weights)


def is_sparse_layer(config, layer_index: int) -> bool:
    """Qwen-MoE's rule: experts in every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (config.num_experts > 0 and layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and (layer_index + 1) % step == 0)


def qwen_moe_mlp(config, layer_index: int, ops: Ops, shared_size: int) -> nn.Module:
    if not is_sparse_layer(config, layer_index):
        return GatedMLP(config.hidden_size, config.intermediate_size, False, ops)
    return SparseMoeBlock(config.hidden_size, ops, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                          intermediate_size=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                          shared_intermediate_size=shared_size)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config) -> dict:
        return {"qkv_bias": bool(getattr(config, "qkv_bias", True)), "o_bias": False, "qk_norm": False}

    @staticmethod
    def build_mlp(config, layer_index: int, ops: Ops) -> nn.Module:
        return qwen_moe_mlp(config, layer_index, ops, int(config.shared_expert_intermediate_size or 0))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def build_mlp(config, layer_index: int, ops: Ops) -> nn.Module:
        return qwen_moe_mlp(config, layer_index, ops, 0)
