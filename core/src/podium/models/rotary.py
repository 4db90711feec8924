"""Rotary position embedding: inverse frequencies from a Hugging Face config, one cos/sin cache.

The cache is ``[max_positions, head_dim]`` float32 holding cos in its first half and sin in its
second, the layout ``podium_plugin_api.ops.rotary_embedding`` reads (neox rotate-half, as in HF
Llama). Supported ``rope_type``: "default", "linear" (positions divided by ``factor``) and
"llama3" (Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth blend between).
A GGUF file may carry the per-frequency divisors themselves (llama.cpp's ``rope_freqs`` tensor);
the loader puts them on the config as ``rope_freq_factors`` and they are applied after the above.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from podium_plugin_api import RotaryInputs

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def head_dim_of(config) -> int:
    """Per-head size: ``config.head_dim`` when set, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config) -> dict:
    """The config's rope settings as one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``config.rope_parameters``; older versions in ``rope_theta``
    plus an optional ``rope_scaling`` dict (whose type key may be spelled ``type``).
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def scaled_context_length(config) -> int:
    """Positions the model can address: max_position_embeddings, times ``factor`` for linear rope."""
    length = int(config.max_position_embeddings)
    params = rope_parameters(config)
    if params["rope_type"] == "linear":
        length = int(length * float(params["factor"]))
    return length


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: divide low frequencies by ``factor``, keep high ones, blend the band between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)  # 0 at the low band edge, 1 at the high one
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


_SCALERS: dict[str, Callable[[torch.Tensor, dict], torch.Tensor]] = {
    "default": lambda inv_freq, params: inv_freq,
    "linear": lambda inv_freq, params: inv_freq / float(params["factor"]),
    "llama3": _llama3_inv_freq,
}


def inverse_frequencies(config) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies for ``config`` (on the CPU)."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in _SCALERS:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported (every head dimension is rotated)")
    dim = head_dim_of(config)
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    inv_freq = _SCALERS[rope_type](inv_freq, params)
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        factors = torch.as_tensor(factors, dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freq_factors has {factors.numel()} entries; head_dim {dim} needs {dim // 2}")
        inv_freq = inv_freq / factors
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin cache; ``inputs(positions)`` hands it, the positions and the rotary op to the
    attention backend, which rotates q [T, H, D] and k [T, Hkv, D] (``forward_rotary``)."""

    def __init__(self, config, rotary_op: Callable) -> None:
        super().__init__()
        self.rotary_op = rotary_op
        self.max_positions = scaled_context_length(config)
        self.inv_freq_host = inverse_frequencies(config)  # [D/2] float32, CPU; the cache is built from it
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the cache on this module's device: call after materializing a meta model."""
        device = self.cos_sin_cache.device
        if device.type == "meta":
            self.cos_sin_cache = torch.empty(self.max_positions, 2 * self.inv_freq_host.numel(), device=device)
            return
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * self.inv_freq_host.to(device)[None, :]  # [P, D/2]
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, D] float32

    def inputs(self, positions: torch.Tensor) -> RotaryInputs:
        """What the attention backend needs to rotate a step's q and k (``forward_rotary``)."""
        return RotaryInputs(positions, self.cos_sin_cache, self.rotary_op)
