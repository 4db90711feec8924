"""Podium: an LLM inference engine whose hardware support comes from platform plugins.

``from podium import LLM, SamplingParams`` is the offline API. Importing this package is cheap
and has no side effects: the engine modules load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "podium.llm",
    "SamplingParams": "podium.sampling_params",
    "StructuredOutputsParams": "podium.sampling_params",
    "ReasoningMarkers": "podium.sampling_params",
    "RequestOutput": "podium.outputs",
    "CompletionOutput": "podium.outputs",
    "PoolingParams": "podium.pooling_params",
    "PoolerConfig": "podium.pooling_config",
    "PoolingRequestOutput": "podium.outputs",
    "EmbeddingRequestOutput": "podium.outputs",
    "EngineConfig": "podium.config",
    "LLMEngine": "podium.engine",
    "Tenant": "podium.tenant",
    "LoRARequest": "podium.lora.request",
    "decode_token": "podium.detokenizer",
    "token_bytes": "podium.detokenizer",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'podium' has no attribute {name!r}")
