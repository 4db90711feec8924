"""Named ops a platform may override, with their pure-torch reference implementations.

The core's layers call these through an op table (name -> callable) built from the defaults below
and the selected platform's ``custom_ops()``; the test kit checks each override against the
reference here. Shapes: T tokens, H heads, D head size, B batch rows, V vocabulary.

Two ops join an elementwise op to the projection after it, for platforms whose kernels
fuse the pair (a one-row GEMV with the norm in its prologue, say): ``rms_norm_linear`` and
``silu_and_mul_linear``. They take the model's projection *module* (``linear``: an ``nn.Linear``,
whatever the platform's ``prepare_model`` made of it, or a quantization method's layer, which names
the quantized op it computes with: ``podium_plugin_api.quantization.quantized_call``) and must equal
calling it on the elementwise op's result. Where a platform does not override them, ``build_op_table`` composes them
from the table's own ``rms_norm`` / ``fused_add_rms_norm`` / ``silu_and_mul``, so a platform that
overrides only those loses nothing.

``fused_moe`` is a mixture-of-experts layer's expert computation over the routed tokens;
its reference and the expert-weight layout live in ``podium_plugin_api.moe``.
``encoder_attention`` is an encoder's (BERT's) bidirectional attention over a ragged batch without
a KV cache; its reference lives in ``podium_plugin_api.encoder_attention``.

``gguf_linear`` and ``gguf_embedding`` compute with GGUF weights kept in ggml's block formats (a
quantization method's layers call them); their reference and the layouts live in
``podium_plugin_api.gguf_blocks``. ``fp8_linear`` is the FP8 W8A8 product (``podium_plugin_api.fp8``),
``int4_linear`` the INT4 weight-only (AWQ / GPTQ) one (``podium_plugin_api.int4``).
``apply_token_bitmask`` is structured output's mask: the tokens a grammar forbids get -inf, in
place (a platform's kernel writes only those entries; the reference unpacks the whole mask).

``lora_shrink`` and ``lora_expand`` are batched LoRA over a step's rows, each row with its own
adapter slot or none; their reference, the slot-weight layout and the per-step ``LoRAMapping``
live in ``podium_plugin_api.lora``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .encoder_attention import encoder_attention
from .fp8 import fp8_linear
from .gguf_blocks import gguf_embedding, gguf_linear
from .int4 import int4_linear
from .lora import lora_expand, lora_shrink
from .moe import fused_moe


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> weight * x / rms(x), computed in float32, returned in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm residual stream of a decoder layer."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (rotate halves).

    positions [T] int, query [T, H, D], key [T, Hkv, D], cos_sin_cache [max_pos, D] holding
    cos in its first D/2 columns and sin in the last D/2 -> rotated (query, key), same dtypes.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up  [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _norm_linear(rms_norm: Callable, fused_add_rms_norm: Callable) -> Callable:
    def rms_norm_linear(x, residual, weight, eps, linear):
        """x [T, K], residual [T, K] or None -> (linear(rms_norm(x + residual)) [T, N], x + residual).

        A pre-norm block's norm and first projection (residual None: (linear(rms_norm(x)), x)).
        """
        if residual is None:
            return linear(rms_norm(x, weight, eps)), x
        normed, summed = fused_add_rms_norm(x, residual, weight, eps)
        return linear(normed), summed

    return rms_norm_linear


def _silu_linear(silu_and_mul: Callable) -> Callable:
    def silu_and_mul_linear(x, linear):
        """x [T, 2I] = [gate | up] -> linear(silu_and_mul(x)) [T, N]: a gated MLP's activation and down
        projection."""
        return linear(silu_and_mul(x))

    return silu_and_mul_linear


rms_norm_linear = _norm_linear(rms_norm, fused_add_rms_norm)
silu_and_mul_linear = _silu_linear(silu_and_mul)

# the composite ops, built from a table's own primitives where a platform does not override them
COMPOSED_OPS: dict[str, Callable[[dict[str, Callable]], Callable]] = {
    "rms_norm_linear": lambda table: _norm_linear(table["rms_norm"], table["fused_add_rms_norm"]),
    "silu_and_mul_linear": lambda table: _silu_linear(table["silu_and_mul"]),
}


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [B, V] outside each row's top-k (k <= 0: off) and top-p nucleus (p >= 1: off).

    top_k int [B], top_p float [B]. Returns new logits with excluded entries set to -inf; the
    highest-scoring token of every row always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.float().masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each entry
    nucleus = top_p.float()[:, None]
    drop |= (before >= nucleus) & (nucleus < 1.0)  # p = 1 is "off" even where float sums reach 1.0
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> int64 [B]: each row's first index of its maximum, NaN counting as the maximum.

    What greedy sampling takes (torch.argmax's rule).
    """
    return logits.argmax(dim=-1)


_BIT_TABLES: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> [256, 8]: a byte's 8 tokens as 0 / -inf


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] float, bitmask [R, ceil(V / 32)] int32 on logits' device, rows int64 [R] (None:
    rows 0..R-1, R == B) -> logits, with logits[rows[i], t] = -inf where bit t % 32 of word t // 32 of
    bitmask[i] is clear (the token is forbidden), in place. Set bits leave their logits untouched.

    The words' layout is xgrammar's and llguidance's: token t is bit t % 32 of word t // 32, the
    words little-endian, so byte k of word j holds tokens 32 j + 8 k + (0..7).
    """
    vocab = logits.shape[-1]
    key = (logits.device, logits.dtype)
    table = _BIT_TABLES.get(key)
    if table is None:  # bit i of byte value b clear -> -inf, else 0
        bits = torch.tensor([[(b >> i) & 1 for i in range(8)] for b in range(256)], dtype=torch.bool)
        table = _BIT_TABLES[key] = torch.where(bits, 0.0, float("-inf")).to(logits.device, logits.dtype)
    data = bitmask.contiguous().view(torch.uint8).view(-1)  # [R * W * 4]
    # one gather and one add: several times faster on a CPU than unpacking bits and a masked fill
    penalty = table.index_select(0, data.int()).view(bitmask.shape[0], -1)[:, :vocab]  # [R, V]
    if rows is None:
        return logits.add_(penalty)
    return logits.index_copy_(0, rows, logits.index_select(0, rows).add_(penalty))


REFERENCE_OPS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "top_k_top_p": top_k_top_p,
    "argmax": argmax,
    "rms_norm_linear": rms_norm_linear,
    "silu_and_mul_linear": silu_and_mul_linear,
    "fused_moe": fused_moe,
    "encoder_attention": encoder_attention,
    "gguf_linear": gguf_linear,
    "gguf_embedding": gguf_embedding,
    "fp8_linear": fp8_linear,
    "apply_token_bitmask": apply_token_bitmask,
    "int4_linear": int4_linear,
    "lora_shrink": lora_shrink,
    "lora_expand": lora_expand,
}

OP_SIGNATURES: dict[str, str] = {name: (fn.__doc__ or "").strip().splitlines()[0] for name, fn in REFERENCE_OPS.items()}


def build_op_table(overrides: dict[str, Callable[..., Any]] | None = None) -> dict[str, Callable[..., Any]]:
    """The reference ops with ``overrides`` applied; unknown names are an error naming them.

    A composite op (``COMPOSED_OPS``) that is not overridden calls the table's primitives, so it
    uses the platform's fused norm even where the platform has no fused norm + linear.
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(REFERENCE_OPS))
    if unknown:
        raise ValueError(f"unknown custom op(s) {unknown}; known ops are {sorted(REFERENCE_OPS)}")
    table = {**REFERENCE_OPS, **overrides}
    table.update({name: compose(table) for name, compose in COMPOSED_OPS.items() if name not in overrides})
    return table
