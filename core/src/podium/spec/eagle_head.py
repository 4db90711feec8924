"""EAGLE draft heads: one (or a few) decoder layers over the target's hidden states.

EAGLE's entry at position i reads the token at i + 1 and the target's hidden state at i (the state
that predicted that token) and predicts the hidden state at i + 1; the logits of that prediction
propose the token at i + 2. Drafting further feeds the head's own predicted state back in.

EAGLE-1 (checkpoint keys ``fc.weight`` [H, 2H], ``layers.N.*``; the target's embedding and lm_head)::

    x = fc(cat(embed(token), target_hidden))           # the target's last (normed) hidden state
    layer 0 without its input norm, later layers as usual; out = hidden + residual -> target lm_head

EAGLE-3 (``fc.weight`` [H, 3H] over three target layers' inputs, ``midlayer.*``, ``norm.weight``, its
own ``lm_head.weight`` [draft_vocab, H] with ``d2t``: target id = draft id + d2t[draft id])::

    x = fc(cat(aux_low, aux_mid, aux_high))            # once per target position (``combine``)
    attention over cat(input_layernorm(embed(token)), hidden_norm(x))   # q/k/v take 2H
    residual = x; then post-attention norm, MLP; out, next = norm(mlp + residual)  -> own lm_head

The head's forward keeps the runner's signature ``(input_ids, positions, ctx)``: the hidden input
is read from ``hidden_in[:T]`` and the state for the next drafting step written to
``hidden_out[:T]``, static buffers the caller fills and reads, so a captured graph of the head
replays with new inputs like any decode step.
"""

from __future__ import annotations

import torch
from torch import nn

from podium_plugin_api import ForwardContext

from ..models.layers import Attention, GatedMLP, RMSNorm
from ..models.llama import DecoderLayer
from ..models.rotary import RotaryEmbedding


class _Borrowed:
    """A target module the head calls without owning it (not a submodule: no parameters to load)."""

    def __init__(self, fn) -> None:
        self.fn = fn


class EagleHead(nn.Module):
    def __init__(self, config, ops, eagle3: bool, target_hidden: int, max_tokens: int, fc_bias: bool = False,
                 own_embedding: bool = False, own_lm_head: bool = True) -> None:
        super().__init__()
        self.config, self.eagle3 = config, eagle3
        hidden = config.hidden_size
        self.fc = nn.Linear((3 if eagle3 else 2) * target_hidden, hidden, bias=fc_bias)
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden,
                                             _weight=torch.empty(config.vocab_size, hidden))
        self.rotary_emb = RotaryEmbedding(config, ops["rotary_embedding"])
        options = {"qkv_bias": bool(getattr(config, "attention_bias", False)),
                   "o_bias": bool(getattr(config, "attention_bias", False)), "qk_norm": False}
        if eagle3:
            self.midlayer = Eagle3Layer(config, ops, options)
            self.norm = RMSNorm(hidden, config.rms_norm_eps, ops)
            self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
            if own_lm_head:
                self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
            # target id of each draft id (arange + the checkpoint's d2t offsets); set by ``set_vocab_map``
            self.register_buffer("target_ids", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)
            self.maps_vocab = False
        else:
            self.layers = nn.ModuleList(DecoderLayer(config, i, ops, options) for i in range(config.num_hidden_layers))
            self.layers[0].input_layernorm = None  # EAGLE-1's first layer reads fc's output unnormed
        self.register_buffer("hidden_in", torch.zeros(max_tokens, target_hidden if not eagle3 else hidden),
                             persistent=False)
        self.register_buffer("hidden_out", torch.zeros(max_tokens, hidden), persistent=False)
        self._embed: _Borrowed | None = None
        self._target_logits: _Borrowed | None = None

    def borrow(self, target: nn.Module) -> None:
        """Use the target's embedding (unless the checkpoint has its own) and, where the head has no
        lm_head of its own, the target's logits."""
        if not hasattr(self, "embed_tokens"):
            self._embed = _Borrowed(target.model.embed_tokens)
        if not hasattr(self, "lm_head"):
            self._target_logits = _Borrowed(target.compute_logits)

    def set_vocab_map(self, d2t: torch.Tensor | None) -> None:
        """EAGLE-3's draft -> target offsets (None: the draft vocabulary is the target's)."""
        ids = torch.arange(self.draft_vocab_size, device=self.target_ids.device)
        if d2t is not None:
            ids = ids + d2t.to(self.target_ids.device, torch.long)
        self.target_ids.copy_(ids)
        self.maps_vocab = self.draft_vocab_size != self.config.vocab_size or d2t is not None and bool(d2t.any())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) if self._embed is None else self._embed.fn(input_ids)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's states [T, H_in] as this head's hidden input: EAGLE-3's fc over the three
        layers' states [T, 3H] -> [T, H]; EAGLE-1 reads the target's state as it is."""
        return self.fc(target_hidden) if self.eagle3 else target_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = input_ids.shape[0]
        hidden_in = self.hidden_in[:tokens]  # [T, H_in]
        rotary = self.rotary_emb.inputs(positions)
        embeds = self.embed(input_ids)  # [T, H]
        if self.eagle3:
            out, following = self.midlayer(embeds, hidden_in, rotary, ctx, self.norm)
        else:
            out = following = self._eagle1(embeds, hidden_in, rotary, ctx)
        self.hidden_out[:tokens].copy_(following)
        return out  # [T, H]

    def _eagle1(self, embeds, hidden_in, rotary, ctx) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, hidden_in.to(embeds.dtype)], dim=-1))  # [T, H]
        first = self.layers[0]
        attn = first.self_attn(x, rotary, ctx)
        hidden, residual = first.mlp.forward_normed(first.post_attention_layernorm, attn, x)
        for layer in self.layers[1:]:
            hidden, residual = layer(hidden, residual, rotary, ctx)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, target vocab]; EAGLE-3's reduced vocabulary is scattered into the target's
        ids (the others stay -inf: never proposed)."""
        if self._target_logits is not None:
            return self._target_logits.fn(hidden)
        logits = self.lm_head(hidden)  # [N, draft_vocab]
        if not self.maps_vocab:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))  # [N, V]
        full[:, self.target_ids] = logits
        return full


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: attention over [normed embedding | normed hidden] (q/k/v from 2H)."""

    def __init__(self, config, ops, options: dict) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.hidden_norm = RMSNorm(hidden, eps, ops)
        self.self_attn = Attention(config, 0, ops, **options)
        qkv = self.self_attn.qkv_proj
        self.self_attn.qkv_proj = nn.Linear(2 * hidden, qkv.out_features, bias=qkv.bias is not None)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.mlp = GatedMLP(hidden, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), ops)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds, hidden_in, rotary, ctx, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output [T, H] for the logits, pre-norm output [T, H]: the next step's hidden input)."""
        normed = self.hidden_norm(hidden_in)
        residual = normed if self.norm_before_residual else hidden_in
        attn = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), rotary, ctx)
        hidden, residual = self.mlp.forward_normed(self.post_attention_layernorm, attn, residual)
        return norm(hidden, residual)
