"""A tiny Llama-like decoder in plain torch, for the kit's end-to-end generation check.

Pre-norm decoder layers (RMSNorm, rotary attention with GQA, SiLU-gated MLP), random weights from
a fixed seed. The model knows nothing about caches: each layer hands its rotated query and new
key/value to an ``attend(layer_index, q, k, v)`` callable, which is either the platform's paged
attention backend or a dense causal reference. Ops come from an op table (name -> callable), so
the platform's custom ops run inside it exactly as the core would use them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ops import REFERENCE_OPS

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32
    intermediate_size: int = 192
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_positions: int = 128
    logit_scale: float = 4.0  # sharpens the random model's logits so greedy choices are clear-cut

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_size


def _random_weights(cfg: TinyConfig, seed: int) -> dict[str, torch.Tensor]:
    """float64 CPU weights, scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_size

    def normal(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) / fan_in**0.5

    weights = {"embed": normal(cfg.vocab_size, h, fan_in=1), "final_norm": 1 + 0.1 * normal(h, fan_in=1)}
    weights["lm_head"] = normal(cfg.vocab_size, h, fan_in=h) * cfg.logit_scale
    for n in range(cfg.num_layers):
        weights[f"{n}.attn_norm"] = 1 + 0.1 * normal(h, fan_in=1)
        weights[f"{n}.qkv"] = normal((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, fan_in=h)
        weights[f"{n}.o"] = normal(h, h, fan_in=h)
        weights[f"{n}.mlp_norm"] = 1 + 0.1 * normal(h, fan_in=1)
        weights[f"{n}.gate_up"] = normal(2 * i, h, fan_in=h)
        weights[f"{n}.down"] = normal(h, i, fan_in=i)
    return weights


def rotary_cache(cfg: TinyConfig) -> torch.Tensor:
    """[max_positions, head_size] float64: cos in the first half of each row, sin in the second."""
    inv_freq = cfg.rope_theta ** (-torch.arange(0, cfg.head_size, 2, dtype=torch.float64) / cfg.head_size)
    angles = torch.arange(cfg.max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class TinyLlama:
    """The same random model in any dtype/device: ``TinyLlama(cfg, seed, dtype, device, ops)``."""

    def __init__(self, cfg: TinyConfig, seed: int, dtype: torch.dtype, device: torch.device | str, ops=None) -> None:
        self.cfg = cfg
        self.ops = {**REFERENCE_OPS, **(ops or {})}
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in _random_weights(cfg, seed).items()}
        self.cos_sin = rotary_cache(cfg).to(device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """tokens, positions [T] -> logits [T, vocab]; ``attend`` sees each layer's q [T,H,D], k/v [T,Hkv,D]."""
        cfg, w, ops = self.cfg, self.w, self.ops
        num_tokens, d = tokens.shape[0], cfg.head_size
        x = w["embed"][tokens]  # [T, hidden]
        for n in range(cfg.num_layers):
            h = ops["rms_norm"](x, w[f"{n}.attn_norm"], cfg.rms_eps)
            qkv = h @ w[f"{n}.qkv"].T  # [T, (H + 2 Hkv) D]
            q, k, v = qkv.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=-1)
            q, k = ops["rotary_embedding"](
                positions,
                q.reshape(num_tokens, cfg.num_heads, d),
                k.reshape(num_tokens, cfg.num_kv_heads, d),
                self.cos_sin,
            )
            v = v.reshape(num_tokens, cfg.num_kv_heads, d)
            attn = attend(n, q.contiguous(), k.contiguous(), v.contiguous())  # [T, H, D]
            x = x + attn.reshape(num_tokens, -1) @ w[f"{n}.o"].T
            h = ops["rms_norm"](x, w[f"{n}.mlp_norm"], cfg.rms_eps)
            x = x + ops["silu_and_mul"](h @ w[f"{n}.gate_up"].T) @ w[f"{n}.down"].T
        return ops["rms_norm"](x, w["final_norm"], cfg.rms_eps) @ w["lm_head"].T
