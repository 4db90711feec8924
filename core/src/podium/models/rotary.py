"""Rotary position embedding: one cos/sin cache per rope setting, built from a Hugging Face config.

The cache is ``[max_positions, R]`` float32 holding cos in its first half and sin in its second, the
layout ``podium_plugin_api.ops.rotary_embedding`` reads (neox rotate-half, as in HF Llama); ``R`` is
the rotary dimension (``head_dim * partial_rotary_factor``). Row ``p`` holds the angles of position
``p`` under the config's rope type (``rope_scaling``: default, linear, llama3, yarn, dynamic,
longrope), times the type's attention factor. A GGUF file may carry per-frequency divisors
(llama.cpp's ``rope_freqs`` tensor); the loader puts them on the config as ``rope_freq_factors``.
Models with a rope setting per layer type (Gemma 3's local and global layers) build one per type.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from podium_plugin_api import RotaryInputs

from .rope_scaling import (
    SUPPORTED_ROPE_TYPES,
    attention_factor,
    checked_rope_parameters,
    head_dim_of,
    inverse_frequencies,
    rope_parameters,
    rotary_angles,
    rotary_dim,
    scaled_context_length,
)

__all__ = ["SUPPORTED_ROPE_TYPES", "RotaryEmbedding", "head_dim_of", "inverse_frequencies", "rope_parameters",
           "rotate_partial", "scaled_context_length"]


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin cache; ``inputs(positions)`` hands it, the positions and the rotary op to the
    attention backend, which rotates q [T, H, D] and k [T, Hkv, D] (``forward_rotary``)."""

    def __init__(self, config, rotary_op: Callable, layer_type: str | None = None) -> None:
        super().__init__()
        self.config, self.layer_type, self.rotary_op = config, layer_type, rotary_op
        params = checked_rope_parameters(config, layer_type)
        self.rotary_dim = rotary_dim(config, params)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim_of(config):
            raise ValueError(f"rotary dimension {self.rotary_dim} (head_dim {head_dim_of(config)} x partial_rotary_factor "
                             f"{params['partial_rotary_factor']}) must be even and between 2 and head_dim")
        self.max_positions = scaled_context_length(config)
        self.scale = attention_factor(config, layer_type)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the cache on this module's device: call after materializing a meta model."""
        device = self.cos_sin_cache.device
        if device.type == "meta":
            self.cos_sin_cache = torch.empty(self.max_positions, self.rotary_dim, device=device)
            return
        positions = torch.arange(self.max_positions, device=device)
        angles = rotary_angles(self.config, positions, self.layer_type)  # [P, R/2]
        self.cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1) * self.scale  # [P, R] float32

    def inputs(self, positions: torch.Tensor) -> RotaryInputs:
        """What the attention backend needs to rotate a step's q and k (``forward_rotary``)."""
        return RotaryInputs(positions, self.cos_sin_cache, self.rotary_op)


def rotate_partial(rotary: RotaryInputs, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] with only their first R dimensions rotated (R: the cache's width < D)."""
    width = rotary.cos_sin_cache.shape[1]
    q_rot, k_rot = rotary.rotate(rotary.positions, query[..., :width].contiguous(), key[..., :width].contiguous(),
                                 rotary.cos_sin_cache)
    return torch.cat((q_rot, query[..., width:]), dim=-1), torch.cat((k_rot, key[..., width:]), dim=-1)
