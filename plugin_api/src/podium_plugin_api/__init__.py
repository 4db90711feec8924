"""Podium's platform plugin contract.

A platform plugin depends on this package only: it subclasses ``Platform`` (and optionally
``AttentionBackend``, ``GraphRunner`` and ``StepShaping``) and returns its platforms from a
``podium_platforms`` hook implementation registered under the ``podium`` entry-point group.
``discovery`` finds them, for the core and for the conformance kit.

Names load on first use, so importing the package (as pytest does for the kit's entry point)
does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "AttentionBackend": ".attention",
    "to_cache_dtype": ".attention",
    "ForwardContext": ".context",
    "Communicator": ".distributed",
    "PlatformEntry": ".discovery",
    "PlatformSelectionError": ".discovery",
    "PluginError": ".discovery",
    "Plugins": ".discovery",
    "load_plugins": ".discovery",
    "PROJECT_NAME": ".hookspecs",
    "PluginApiDeprecationWarning": ".hookspecs",
    "hookimpl": ".hookspecs",
    "hookspec": ".hookspecs",
    "AttentionLayerSpec": ".metadata",
    "AttentionMetadata": ".metadata",
    "KVCacheSpec": ".metadata",
    "RotaryInputs": ".metadata",
    "fp8_dtypes": ".metadata",
    "LoRAMapping": ".lora",
    "lora_mapping": ".lora",
    "MoEExperts": ".moe",
    "QuantizationMethod": ".quantization",
    "quantized_call": ".quantization",
    "Availability": ".platform",
    "Capabilities": ".platform",
    "GraphCaptureUnsupported": ".platform",
    "GraphRunner": ".platform",
    "MemoryInfo": ".platform",
    "Platform": ".platform",
    "PlatformOption": ".options",
    "resolve_options": ".options",
    "HostBatch": ".step_shape",
    "StepShaping": ".step_shape",
    "reference_paged_attention": ".reference",
    "API_VERSION": ".version",
    "compatibility_problem": ".version",
    "parse_version": ".version",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'podium_plugin_api' has no attribute {name!r}")
