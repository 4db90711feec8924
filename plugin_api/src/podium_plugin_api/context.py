"""What one forward pass needs besides token ids and positions, passed explicitly to the model.

A model's ``forward(input_ids, positions, ctx)`` takes a ``ForwardContext``; it lives in the
contract so that a plugin's own model class (``podium_model_architectures``) can type it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionBackend
from .metadata import AttentionMetadata


@dataclass
class ForwardContext:
    """One step's attention inputs: the flat-batch metadata, every layer's cache, the backend.

    ``kv_caches[i]`` is layer i's cache tensor in ``backend``'s layout.
    """

    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
