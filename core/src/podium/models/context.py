"""What one forward pass needs besides token ids and positions, passed explicitly to the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from podium_plugin_api import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """One step's attention inputs: the flat-batch metadata, every layer's cache, the backend.

    ``kv_caches[i]`` is layer i's cache tensor in ``backend``'s layout.
    """

    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
