"""BERT-family encoders (``BertModel``: all-MiniLM, BGE, E5, ...) for embeddings.

Post-norm transformer layers over absolute position embeddings; attention is bidirectional within
each input and uses no KV cache: the whole input is computed in one step through the contract's
``encoder_attention`` op (a platform may override it; the reference pads and masks), and the model
is never asked to decode. Every input is one segment (token type 0), as sentence-transformers
encodes a sentence. Parameter names follow Hugging Face except the merged ``qkv`` projection of
``attention.self`` (query|key|value); checkpoints saved from ``BertFor*`` (``bert.`` prefix, task
heads) load too, their heads ignored.

    forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]   (sequences end to end)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from podium_plugin_api import ForwardContext

from .layers import Ops
from .weights import load_hf_weights

_ACTIVATIONS = {
    "gelu": lambda x: nn.functional.gelu(x),
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": nn.functional.relu,
}
# checkpoint tensors no embedding uses: the pooler head, BertFor* task heads, old position-id buffers
_IGNORED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        # built with their weights (uninitialized; the loader fills them), as the decoder's embedding is
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, _weight=torch.empty(config.vocab_size, hidden))
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden,
                                                _weight=torch.empty(config.max_position_embeddings, hidden))
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden,
                                                  _weight=torch.empty(config.type_vocab_size, hidden))
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        token_types = torch.zeros_like(input_ids)  # one segment per input
        summed = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(summed + self.token_type_embeddings(token_types))  # [T, hidden]


class BertSelfAttention(nn.Module):
    def __init__(self, config, ops: Ops) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, hidden // config.num_attention_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.merged_shards = {"query": ("qkv", 0, hidden), "key": ("qkv", hidden, hidden),
                              "value": ("qkv", 2 * hidden, hidden)}
        self.encoder_attention = ops["encoder_attention"]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).reshape(tokens, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)  # [T, H, D] each
        meta = ctx.meta
        out = self.encoder_attention(q, k, v, meta.query_start_loc, meta.query_lens_host, self.head_dim**-0.5)
        return out.reshape(tokens, -1)  # [T, hidden]


class BertOutput(nn.Module):
    """LayerNorm(dense(x) + residual): the post-norm end of both halves of a layer."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config, ops: Ops) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, ops)
        self.output = BertOutput(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.output(self.self(x, ctx), x)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config, ops: Ops) -> None:
        super().__init__()
        self.attention = BertAttention(config, ops)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.attention(x, ctx)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config, ops: Ops) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, ops) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """``cls(config, ops)``; ``forward(input_ids [T], positions [T], ctx) -> [T, hidden]``."""

    pooling_only = True  # an encoder: it embeds, it does not generate
    uses_kv_cache = False  # whole inputs in one step, attention within the step

    def __init__(self, config, ops: Ops) -> None:
        super().__init__()
        check_bert_config(config)
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, ctx)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from Hugging Face (name, tensor) pairs; ValueError naming any mismatch."""
        load_hf_weights(self, ((name.removeprefix("bert."), tensor) for name, tensor in weights
                               if not name.startswith("cls.")), _IGNORED)


def check_bert_config(config) -> None:
    """Refuse what this encoder does not implement, naming it."""
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"BertModel with position_embedding_type={kind!r} is not supported; Podium's BERT uses "
                         "absolute position embeddings")
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"BertModel hidden_act {config.hidden_act!r} is not supported; supported: "
                         f"{', '.join(_ACTIVATIONS)}")
    if getattr(config, "is_decoder", False):
        raise ValueError("a BertModel with is_decoder=True (causal BERT) is not supported; Podium's BERT is an encoder")
