"""The building blocks of a Llama-family decoder: RMSNorm, gated MLP, attention.

Layers compute through the op table (``ops["rms_norm"]`` ...), so a platform's fused kernels
replace the pure-torch references without touching the model. Merged projections (q|k|v,
gate|up) keep one matmul each; ``merged_shards`` tells the weight loader where each Hugging Face
tensor goes inside them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from podium_plugin_api import AttentionLayerSpec, ForwardContext, RotaryInputs

from .rotary import head_dim_of, rotate_partial

Ops = dict[str, Callable]


class RMSNorm(nn.Module):
    """weight * x / rms(x). With ``residual``: returns (norm(x + residual), x + residual)."""

    def __init__(self, size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = float(eps)
        self.rms_norm, self.fused_add_rms_norm = ops["rms_norm"], ops["fused_add_rms_norm"]
        self.rms_norm_linear = ops["rms_norm_linear"]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.rms_norm(x, self.weight, self.eps)
        return self.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def then(self, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual) through one op, which a platform may fuse."""
        return self.rms_norm_linear(x, residual, self.weight, self.eps, linear)


def gelu_tanh_and_mul_linear(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> linear(gelu_tanh(gate) * up): GeGLU (Gemma's ``gelu_pytorch_tanh``)."""
    gate, up = x.chunk(2, dim=-1)
    return linear(torch.nn.functional.gelu(gate, approximate="tanh") * up)


GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up merged into one projection; act SiLU or GELU-tanh."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops: Ops, activation: str = "silu") -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_and_mul_linear = ops["silu_and_mul_linear"] if activation == "silu" else gelu_tanh_and_mul_linear
        size = intermediate_size
        self.merged_shards = {"gate_proj": ("gate_up_proj", 0, size), "up_proj": ("gate_up_proj", size, size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))  # [T, hidden] -> [T, 2I] -> [T, hidden]

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> down(act(gate) * up) [T, hidden]: one op, which a platform may fuse."""
        return self.act_and_mul_linear(gate_up, self.down_proj)

    def forward_normed(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None):
        """(self(norm(hidden + residual)), hidden + residual), the norm run with gate_up as one op
        (``rms_norm_linear``), which a platform may fuse: the decoder layer's MLP half."""
        gate_up, residual = norm.then(self.gate_up_proj, hidden, residual)
        return self.down(gate_up), residual


def layer_sliding_window(config, layer_index: int) -> int | None:
    """The attention window of one layer, or None for full attention.

    Configs with ``layer_types`` (Qwen2/3 in transformers >= 4.53) say it per layer; older Qwen2
    configs say it with ``use_sliding_window`` and ``max_window_layers`` (layers from that index on
    slide); Mistral has one ``sliding_window`` for every layer (None: off).
    """
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_index] == "sliding_attention" else None
    if hasattr(config, "use_sliding_window"):
        if not config.use_sliding_window:
            return None
        return int(window) if layer_index >= getattr(config, "max_window_layers", 0) else None
    return int(window)


class Attention(nn.Module):
    """Self-attention with merged q|k|v, optional per-head q/k RMSNorm, rotary, paged KV via the backend.

    ``scale`` (default head_dim ** -0.5) and ``soft_cap`` (scores -> cap * tanh(scores / cap)) go to
    the backend in the layer's spec; ``norm`` is the q/k norm's class (Gemma's adds 1 to its weight).
    A rotary cache narrower than the head (``partial_rotary_factor``) rotates the leading dimensions
    here and hands the backend rotated q/k (``forward``); a full-width one goes to ``forward_rotary``.
    """

    def __init__(
        self, config, layer_index: int, ops: Ops, *, qkv_bias: bool, o_bias: bool, qk_norm: bool,
        scale: float | None = None, soft_cap: float | None = None, norm: type[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.head_splits = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        self.merged_shards = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
        }
        norm = norm or RMSNorm
        self.q_norm = norm(self.head_dim, config.rms_norm_eps, ops) if qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps, ops) if qk_norm else None
        self.spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            scale=self.head_dim**-0.5 if scale is None else float(scale),
            sliding_window=layer_sliding_window(config, layer_index),
            soft_cap=None if soft_cap is None else float(soft_cap),
        )

    def forward(self, x: torch.Tensor, rotary: RotaryInputs, ctx: ForwardContext) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), rotary, ctx)

    def attend(self, qkv: torch.Tensor, rotary: RotaryInputs, ctx: ForwardContext) -> torch.Tensor:
        """The projected q|k|v [T, (H + 2 Hkv) D] -> o_proj(attention) [T, hidden]."""
        tokens = qkv.shape[0]
        qkv = qkv.reshape(tokens, -1, self.head_dim)  # [T, H + 2 Hkv, D]
        q, k, v = qkv.split_with_sizes(self.head_splits, dim=1)  # [T, H, D], [T, Hkv, D], [T, Hkv, D] (views)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(q.shape)  # norm over D, per head
            k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(k.shape)
        cache = ctx.kv_caches[self.layer_index]
        if rotary.cos_sin_cache.shape[1] != self.head_dim:  # partial rotary: leading dimensions only
            q, k = rotate_partial(rotary, q, k)
            out = ctx.backend.forward(self.spec, q, k, v, cache, ctx.meta)  # [T, H, D]
        else:  # rotary on q and k, the cache write and attention: the backend may do all three in one pass
            out = ctx.backend.forward_rotary(self.spec, q, k, v, cache, ctx.meta, rotary)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, -1))  # [T, hidden]
