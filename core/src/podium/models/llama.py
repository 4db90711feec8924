"""The Llama-family decoder: Llama 2/3 (SmolLM2), Mistral, Qwen2/2.5, Qwen3.

One stack; the architectures differ only in a few switches read from the config:

    Llama/Mistral  bias on q/k/v/o from ``attention_bias``, MLP bias from ``mlp_bias``
    Qwen2          bias on q/k/v always, none on o
    Qwen3          per-head RMSNorm on q and k before rotary
    all            ``head_dim`` when the config has it; tied embeddings from ``tie_word_embeddings``;
                   sliding window per layer (``layers.layer_sliding_window``); rope scaling (``rotary``)

Parameter names follow Hugging Face (``model.layers.N.self_attn...``), except the merged
``qkv_proj`` and ``gate_up_proj``; ``load_weights`` maps the checkpoint's names onto them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from podium_plugin_api import ForwardContext, RotaryInputs

from .layers import Attention, GatedMLP, Ops, RMSNorm
from .rotary import RotaryEmbedding
from .weights import load_hf_weights


def dense_mlp(config, layer_index: int, ops: Ops) -> nn.Module:
    """The Llama family's MLP: gated SiLU, bias from ``mlp_bias``."""
    return GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), ops)


MlpFactory = Callable[[object, int, Ops], nn.Module]


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP; the residual stream is carried through fused add-norms.

    The MLP is any module with ``forward_normed(norm, hidden, residual)``: a dense ``GatedMLP`` or
    a mixture of experts (``moe.SparseMoeBlock``), built by the model class's ``build_mlp``.
    """

    def __init__(self, config, layer_index: int, ops: Ops, attention_options: dict,
                 build_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.self_attn = Attention(config, layer_index, ops, **attention_options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.mlp = build_mlp(config, layer_index, ops)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryInputs, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # each norm runs with the projection after it, and SiLU-mul with down: one op each, which a
        # platform may fuse (a batch-1 GEMV with the norm in its prologue)
        qkv, residual = self.input_layernorm.then(self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn.attend(qkv, rotary, ctx)
        return self.mlp.forward_normed(self.post_attention_layernorm, hidden, residual)


class DecoderStack(nn.Module):
    """Embedding, decoder layers, final norm: HF's ``model.*`` submodule."""

    def __init__(self, config, ops: Ops, attention_options: dict, build_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        # built with its weight (uninitialized; the loader fills it): nn.Embedding's own init on the
        # meta device imports torch._dynamo for its normal_ decomposition, ~0.5 s of startup
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, ops, attention_options, build_mlp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(config, ops["rotary_embedding"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        rotary = self.rotary_emb.inputs(positions)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rotary, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden  # [T, hidden]


class LlamaForCausalLM(nn.Module):
    """``cls(config, ops)``; ``forward(input_ids [T], positions [T], ctx) -> [T, hidden]``."""

    def __init__(self, config, ops: Ops) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_stack(config, ops)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Tied embeddings: ``lm_head.weight`` is the embedding's parameter (again, after ``build_model``
        materializes the model, which unties shared parameters).

        The head stays a module either way, so transformations applied to the model (a platform's
        packed or quantized linears) reach the logits too.
        """
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def attention_options(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    build_mlp = staticmethod(dense_mlp)

    def build_stack(self, config, ops: Ops) -> nn.Module:
        """HF's ``model.*`` submodule: embedding, layers, final norm."""
        return DecoderStack(config, ops, self.attention_options(config), self.build_mlp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model's dtype.

        Not upcast here: a greedy row's argmax is the same in bf16 as in float32 (the upcast is
        exact and keeps order), so the sampler upcasts only the rows that compute with the values
        (temperature, penalties, logprobs), and the common all-greedy step skips a [N, vocab] copy.
        """
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from Hugging Face (name, tensor) pairs; ValueError naming any mismatch.

        Skipped: rotary ``inv_freq`` buffers of old checkpoints and, with tied embeddings,
        ``lm_head.weight`` (it is the embedding).
        """
        ignore = ["rotary_emb.inv_freq"] + (["lm_head.weight"] if self.tie_word_embeddings else [])
        load_hf_weights(self, (_with_model_prefix(name, tensor) for name, tensor in weights), ignore)


def _with_model_prefix(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Checkpoints saved from the bare stack (``LlamaModel``) lack the ``model.`` prefix."""
    if name.startswith(("model.", "lm_head.")):
        return name, tensor
    return "model." + name, tensor


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window (read from ``config.sliding_window``)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config) -> dict:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
