"""Quantization in the contract: a method is a transformation of the plain model.

A ``QuantizationMethod`` is built from the checkpoint's description of its quantization (the
``quantization_config`` of config.json, or what a GGUF file's tensor types say) and applied to
the model while it is still on the ``meta`` device: ``apply`` swaps linear (and embedding)
modules for quantized ones whose parameters have the checkpoint's packed shapes and dtypes, so
the weights are allocated packed and loaded as stored. After the weights are in, ``finish`` may
convert them (online quantization of float weights, a kernel's repacking). The model's classes
never see any of it.

The core registers its built-in methods (``gguf``, ``fp8``, ``compressed-tensors``, ``awq``,
``gptq``) the way a plugin would; a plugin adds a format, or replaces a built-in one with its own
kernels, by returning classes from the ``podium_quantization_methods`` hook. Kernels of the
built-in formats are ops of the op table (``gguf_linear``, ...), which a platform overrides
through ``custom_ops`` like any other op.

A quantized layer that computes ``op(x, *args)`` with one of those ops says so: a class attribute
``quantized_op`` (the op's name) and a method ``quantized_args()`` (the op's arguments after x, in
its signature's order). The fused ops that take a projection module (``rms_norm_linear``,
``silu_and_mul_linear``) may then run the elementwise op inside that op's kernel instead of calling
the module; ``quantized_call`` reads the two for them. A layer without them is called as a module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from torch import nn


class QuantizationMethod:
    """One quantization format. Subclasses set ``name`` and implement ``apply``.

    ``config`` is the checkpoint's ``quantization_config`` (a dict; GGUF: ``{"quant_method": "gguf",
    "tensor_types": {hf_name: ggml type id}}``); ``online`` is True when the user asked for the method
    on a float checkpoint (``quantization="fp8"`` on a bf16 model): the method quantizes at ``finish``.
    """

    name: ClassVar[str] = ""
    # the names checkpoints write in quantization_config["quant_method"] for this method
    checkpoint_names: ClassVar[tuple[str, ...]] = ()
    supports_online: ClassVar[bool] = False

    def __init__(self, config: Mapping[str, Any], online: bool = False) -> None:
        if online and not self.supports_online:
            raise ValueError(f"quantization {self.name!r} needs a checkpoint quantized in that format; it cannot "
                             "quantize a float checkpoint at load")
        self.config = dict(config)
        self.online = online

    def apply(self, model: nn.Module, ops: Mapping[str, Callable]) -> None:
        """Replace ``model``'s modules (on the meta device, before weights exist) with quantized ones."""
        raise NotImplementedError

    def kept_checkpoint_names(self) -> frozenset[str]:
        """Checkpoint tensors the loader must hand over as stored (GGUF: its block bytes) rather than
        converted to float; empty for formats whose checkpoints store the packed tensors by name."""
        return frozenset()

    def finish(self, model: nn.Module) -> None:
        """After the weights are loaded: convert or repack them (default: nothing)."""

    def describe(self) -> str:
        return self.name


def quantized_call(linear: nn.Module) -> tuple[str, tuple] | None:
    """(op name, the op's arguments after x) of a layer that declares ``quantized_op`` and
    ``quantized_args`` (module docstring), else None."""
    op = getattr(linear, "quantized_op", None)
    if not isinstance(op, str):
        return None
    return op, tuple(linear.quantized_args())
