"""Quantization as a transformation of the plain model: methods, their registry, weight accounting."""

from .memory import weight_bytes_by_dtype
from .registry import BUILTIN_METHODS, quantization_methods, select_quantization

__all__ = ["BUILTIN_METHODS", "quantization_methods", "select_quantization", "weight_bytes_by_dtype"]
