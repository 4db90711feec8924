"""Starting the engine on a platform: discover, select, activate with its options, bind a device.

One ``Plugins`` (one plugin manager) per engine: it gives the platform and, later, the plugins'
model architectures. The selected platform is activated once with its options resolved and
validated (``EngineConfig.platform_options``, then their environment aliases, then the defaults);
only then is it asked for devices, ops and the rest. A model whose attention needs what the
platform lacks (a sliding window, soft-capped scores) is refused with the reason at load, rather
than computed wrong.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from podium_plugin_api import AttentionLayerSpec, Platform, Plugins, load_plugins, resolve_options

from .config import EngineConfig


@dataclass(frozen=True)
class StartedPlatform:
    platform: Platform
    name: str
    plugins: Plugins


def start_platform(config: EngineConfig, device_index: int = 0, rank: int | None = None) -> StartedPlatform:
    """Discover the plugins, select ``config.device`` (or the best available), activate it with its
    options and bind ``device_index``, or tensor-parallel rank ``rank``'s device (``rank_device``)."""
    plugins = load_plugins()
    entry = plugins.select(config.device)
    platform = entry.platform
    platform.activate(resolve_options(platform.name, platform.options(), config.platform_option_values))
    if rank is not None:
        device_index = platform.rank_device(rank, config.tensor_parallel_size)
    if config.batch_invariant:
        use_batch_invariant_kernels(platform)
    count = platform.device_count()
    if not 0 <= device_index < count:
        raise RuntimeError(f"platform {platform.name!r} has {count} device(s) here; device {device_index} "
                           f"does not exist (check the devices this process may see)")
    platform.set_device(device_index)
    return StartedPlatform(platform, entry.name, plugins)


def use_batch_invariant_kernels(platform: Platform) -> None:
    """Switch ``platform`` to its batch-invariant kernels, or refuse the mode with the reason."""
    caps = platform.capabilities()
    if not caps.batch_invariant:
        why = caps.extra.get("batch_invariant", "it declares no batch-invariant kernels")
        raise ValueError(f"batch_invariant mode is not available on platform {platform.name!r}: {why} "
                         f"(capabilities().batch_invariant is False); run without --batch-invariant or "
                         f"on another platform (--device)")
    platform.use_batch_invariant_kernels()


def attention_specs(model: nn.Module) -> Iterator[AttentionLayerSpec]:
    """Every attention layer's spec the model's modules hold (an attribute of type AttentionLayerSpec)."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, AttentionLayerSpec):
                yield value


def check_attention_support(model: nn.Module, platform: Platform, model_name: str) -> None:
    """Refuse a model whose attention needs a feature ``platform`` does not claim (Capabilities)."""
    caps = platform.capabilities()
    specs = list(attention_specs(model))
    needs = (("sliding_window", "a sliding attention window", [s.sliding_window for s in specs]),
             ("soft_cap", "soft-capped attention scores", [s.soft_cap for s in specs]))
    for capability, feature, values in needs:
        used = [v for v in values if v is not None]
        if used and not getattr(caps, capability):
            raise ValueError(
                f"model {model_name!r} uses {feature} ({capability}={used[0]} in {len(used)} of {len(specs)} "
                f"attention layers), which platform {platform.name!r} does not support "
                f"(capabilities().{capability} is False); run it on another platform (--device)")
