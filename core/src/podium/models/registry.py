"""Architecture name -> model class, model construction and random initialization.

Built-in classes cover the Llama family, its mixture-of-experts relatives, Gemma 2/3, Phi-3 and
BERT encoders (``pooling_only``: they embed, see ``podium.pooling``); a plugin adds or replaces classes through the
``podium_model_architectures`` hook (the engine calls it and passes the merged dict as ``extra``).
A model class is constructed as ``cls(hf_config, ops)``. It is built on the ``meta`` device
(no memory, no initialization), then materialized on the target device uninitialized: weights
come from ``load_weights`` or ``init_random_weights``, and a class with other state (a rotary
cache) recomputes it in ``reset_buffers()``, which ``build_model`` calls after materializing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .bert import BertModel
from .gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from .moe_models import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from .phi3 import Phi3ForCausalLM

BUILTIN_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "BertModel": BertModel,
}

# configs without ``architectures`` (built from GGUF metadata or by hand) fall back to model_type
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "bert": "BertModel"}


def supported_architectures(extra: dict[str, Callable] | None = None) -> dict[str, Callable]:
    """Built-in classes with ``extra`` (from plugins) applied; a plugin entry replaces a built-in one."""
    return {**BUILTIN_ARCHITECTURES, **(extra or {})}


def model_class(hf_config, extra: dict[str, Callable] | None = None) -> Callable:
    """The class for ``hf_config.architectures`` (first supported one), else ValueError listing them."""
    registry = supported_architectures(extra)
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:
        names = [_BY_MODEL_TYPE[hf_config.model_type]]
    for name in names:
        if name in registry:
            return registry[name]
    asked = ", ".join(names) or f"none (model_type {getattr(hf_config, 'model_type', None)!r})"
    raise ValueError(
        f"model architecture {asked} is not supported; supported: {', '.join(sorted(registry))}. "
        "A plugin can add one through the podium_model_architectures hook."
    )


def build_model(
    hf_config,
    ops: dict[str, Callable],
    dtype: torch.dtype,
    device: torch.device | str,
    extra: dict[str, Callable] | None = None,
    transform: Callable[[nn.Module], nn.Module] | None = None,
    quantization=None,
) -> nn.Module:
    """Construct the model on ``device`` in ``dtype`` with uninitialized weights (fill them next).

    ``quantization`` (a ``QuantizationMethod``) is applied on the meta device after the cast to
    ``dtype``, before anything is allocated: its layers' packed weights are the only copy ever made,
    in the dtypes the method gives them (its float layers take ``dtype`` from the modules they replace).
    ``transform`` reshapes the model while it is still on the meta device (tensor parallelism's
    sharding), so only what it keeps is ever allocated. The engine does not pass both: quantized
    layers are not sharded yet (``shard.ModelShard`` refuses the combination)."""
    cls = model_class(hf_config, extra)
    with torch.device("meta"):
        model = cls(hf_config, ops)
        model.to(dtype=dtype)  # free on meta
        if quantization is not None:  # after the cast: packed fp8/int weights and float32 scales keep their dtypes
            quantization.apply(model, ops)
    if transform is not None:
        model = transform(model)
    # model.to_empty(device=device) without its torch.empty_like, whose meta-tensor path imports sympy (~0.4 s)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    return model.eval()


def init_random_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights: normal(0, std) matrices and embeddings, norms 1, biases 0.

    The same seed gives the same weights on the same device type (a generator per device).
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, std, generator=generators[param.device])
