"""Gemma 2 and Gemma 3 (text): the Llama-family attention and gated MLP in Gemma's own layer layout.

    h = embed(ids) * sqrt(hidden)                          (the scale rounded to the model dtype)
    per layer:  x = x + post_attention_norm(attention(input_norm(x)))
                x = x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))       mlp: GeGLU (gelu tanh)
    logits = cap * tanh(lm_head(norm(x)) / cap)            (Gemma 2's final_logit_softcapping)

Every norm is Gemma's RMSNorm, ``x / rms(x) * (1 + weight)`` in float32. Attention scales scores by
``query_pre_attn_scalar ** -0.5``, caps them (Gemma 2's ``attn_logit_softcapping``, the backend's
``soft_cap``) and slides a window on the layers ``layer_types`` marks ``sliding_attention`` (Gemma 2:
every other one; Gemma 3: five of six). Gemma 3 adds per-head q/k norms and rotates its sliding
layers with their own rope base (``rope_parameters["sliding_attention"]``, 10k) and its global ones
with ``rope_parameters["full_attention"]`` (1M, linear scaling on the larger models).
"""

from __future__ import annotations

import torch
from torch import nn

from podium_plugin_api import ForwardContext, RotaryInputs

from .layers import Attention, GatedMLP, Ops
from .llama import LlamaForCausalLM
from .rope_scaling import nested_rope
from .rotary import RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in float32, rounded once. With ``residual``: (norm(x + residual), x + residual)."""

    def __init__(self, size: int, eps: float, ops: Ops | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)


class GemmaDecoderLayer(nn.Module):
    """Norms before and after both the attention and the MLP (module docstring)."""

    def __init__(self, config, layer_index: int, ops: Ops, attention_options: dict) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Attention(config, layer_index, ops, **attention_options)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GatedMLP(size, config.intermediate_size, False, ops, activation=config.hidden_activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.rope_key = config.layer_types[layer_index] if nested_rope(config) else "all"

    def forward(self, x: torch.Tensor, rotary: RotaryInputs, ctx: ForwardContext) -> torch.Tensor:
        attended = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, ctx))
        normed, x = self.pre_feedforward_layernorm(attended, x)  # the MLP's input, and x + attended
        return x + self.post_feedforward_layernorm(self.mlp(normed))  # [T, hidden]


class GemmaStack(nn.Module):
    """Scaled embedding, Gemma layers, final norm: HF's ``model.*`` submodule."""

    def __init__(self, config, ops: Ops, attention_options: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, ops, attention_options)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        kinds = sorted(set(config.layer_types)) if nested_rope(config) else [None]
        self.rotary_embs = nn.ModuleDict({kind or "all": RotaryEmbedding(config, ops["rotary_embedding"], kind)
                                          for kind in kinds})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rotaries = {kind: emb.inputs(positions) for kind, emb in self.rotary_embs.items()}
        for layer in self.layers:
            x = layer(x, rotaries[layer.rope_key], ctx)
        return self.norm(x)  # [T, hidden]


class Gemma2ForCausalLM(LlamaForCausalLM):
    """``cls(config, ops)``; logits soft-capped by ``final_logit_softcapping`` where set."""

    def __init__(self, config, ops: Ops) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not a causal LM; "
                             "Podium serves the causal Gemma models")
        super().__init__(config, ops)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None

    @staticmethod
    def attention_options(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        cap = getattr(config, "attn_logit_softcapping", None)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "scale": config.query_pre_attn_scalar ** -0.5,
                "soft_cap": float(cap) if cap else None}

    def build_stack(self, config, ops: Ops) -> nn.Module:
        return GemmaStack(config, ops, self.attention_options(config))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [N, vocab]
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @staticmethod
    def attention_options(config) -> dict:
        return {**Gemma2ForCausalLM.attention_options(config), "qk_norm": True, "norm": GemmaRMSNorm}
