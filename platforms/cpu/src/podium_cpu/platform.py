"""The CPU platform: host memory for the KV cache, torch's CPU kernels for attention."""

from __future__ import annotations

import torch

from podium_plugin_api import AttentionBackend, Capabilities, Platform

from .attention import CpuAttentionBackend


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 10

    def __init__(self) -> None:
        self._backend = CpuAttentionBackend()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=(torch.float32, torch.bfloat16, torch.float16),
            default_dtype=torch.float32,
            graph_capture=False,
            distributed_backend="gloo",
        )

    def config_defaults(self) -> dict:
        return {"kv_cache_memory": 1 << 30}

    def attention_backend(self) -> AttentionBackend:
        return self._backend
