"""Triton paged attention for CUDA (work in progress: reference attention until kernels land)."""

from __future__ import annotations

from podium_plugin_api import AttentionBackend


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
