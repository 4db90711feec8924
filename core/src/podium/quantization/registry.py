"""Quantization methods by name, and which one a model runs with.

Built-in methods are registered exactly as a plugin's would be; a plugin's method of the same name
(``podium_quantization_methods``) replaces the built-in one. The rule, from the user's setting and
what the checkpoint says (``ModelSource.quantization``):

    checkpoint quantized, setting None or the checkpoint's method  -> the checkpoint's method
    GGUF file, setting None or "none"                               -> none: blocks dequantized at load
    GGUF file, setting "gguf"                                       -> gguf: blocks kept

A GGUF file keeps its blocks only when asked: the CPU block kernels measure faster than the
dequantized path (docs/quantization.md), but the rule cannot yet say per platform whether that
holds (CUDA's block kernels are not measured against cuBLAS) and quantized layers refuse tensor
parallelism, which a dequantized GGUF file supports; the file's block types are what ``gguf`` reads.
    float checkpoint, setting a method that quantizes online (fp8)  -> that method, online
    anything else                                                   -> ValueError naming both
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from podium_plugin_api.quantization import QuantizationMethod

from .fp8 import CompressedTensorsMethod, Fp8Method
from .gguf import GGUFMethod
from .int4 import AWQMethod, GPTQMethod

BUILTIN_METHODS: dict[str, type[QuantizationMethod]] = {
    method.name: method for method in (GGUFMethod, Fp8Method, CompressedTensorsMethod, AWQMethod, GPTQMethod)
}
NONE = "none"


def quantization_methods(extra: Mapping[str, type[QuantizationMethod]] | None = None) -> dict[str, type]:
    """Built-in methods with ``extra`` (from plugins) applied; a plugin entry replaces a built-in one."""
    methods = {**BUILTIN_METHODS, **(extra or {})}
    for name, cls in methods.items():
        if not (isinstance(cls, type) and issubclass(cls, QuantizationMethod)):
            raise ValueError(f"quantization method {name!r} is {cls!r}, not a QuantizationMethod subclass")
    return methods


def _checkpoint_method(checkpoint: Mapping[str, Any], methods: dict[str, type]) -> str:
    written = str(checkpoint.get("quant_method", "")).lower()
    for name, cls in methods.items():
        if written == name or written in cls.checkpoint_names:
            return name
    raise ValueError(f"the checkpoint is quantized with {written!r}, which no installed quantization method "
                     f"reads; methods: {', '.join(sorted(methods))}")


def select_quantization(setting: str | None, checkpoint: Mapping[str, Any] | None,
                        extra: Mapping[str, type[QuantizationMethod]] | None = None) -> QuantizationMethod | None:
    """The method the model runs with (module docstring), constructed; None for plain float weights."""
    methods = quantization_methods(extra)
    if setting is not None and setting != NONE and setting not in methods:
        raise ValueError(f"quantization {setting!r} is not a known method; methods: {', '.join(sorted(methods))}, "
                         f"or {NONE}")
    if checkpoint:
        found = _checkpoint_method(checkpoint, methods)
        if setting in (None, NONE) and found == GGUFMethod.name:
            return None
        if setting not in (None, found):
            raise ValueError(f"quantization={setting!r}, but the checkpoint is quantized with {found!r}; "
                             f"leave quantization unset (or pass {found!r})")
        return methods[found](checkpoint)
    if setting in (None, NONE):
        return None
    return methods[setting]({"quant_method": setting}, online=True)
