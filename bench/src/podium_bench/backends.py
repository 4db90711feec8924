"""Building the backends a benchmark compares, so that both see the same model, dtype and device.

A :class:`Target` is what Podium and transformers must agree on: the model's config, the token
space the datasets draw from, the dtype, the torch device and the platform (which synchronizes
and frees device memory for both: the benchmark reaches devices only through the platform API).
It comes from Podium's engine when Podium runs (so ``--dtype auto`` means whatever the platform
chose), else from Podium's model resolver and platform selection without building an engine.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, fields
from typing import Any

import torch

from podium.config import EngineConfig
from podium.engine_args import resolve_args

from .datasets import TokenSpace
from .hf_backend import HFBackend, load_hf_model
from .podium_backend import PodiumBackend

BACKENDS = ("podium", "hf")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineOptions:
    """The engine arguments a benchmark passes to ``LLM`` (the engine flags given; vLLM's names
    accepted), and the validated ``EngineConfig`` they make."""

    kwargs: dict[str, Any]

    @property
    def config(self) -> EngineConfig:
        return EngineConfig(**resolve_args(self.kwargs)[0])

    def as_dict(self) -> dict[str, Any]:
        """Every engine setting, for the result's JSON."""
        config = self.config
        return {f.name: getattr(config, f.name) for f in fields(config)}


@dataclass
class Target:
    hf_config: Any
    space: TokenSpace
    dtype: torch.dtype
    device: torch.device
    platform: Any  # the podium_plugin_api Platform both backends run on
    platform_name: str
    description: str = ""
    path: str | None = None  # the file or folder the model was loaded from (None: a named shape)


def podium_backend(options: EngineOptions, detokenize: bool = True) -> PodiumBackend:
    return PodiumBackend.create(detokenize, **options.kwargs)


def target_of(backend: PodiumBackend) -> Target:
    engine = backend.engine
    return Target(engine.source.hf_config, backend.token_space(), engine.dtype, engine.device, engine.platform,
                  engine.platform_name, getattr(engine.source, "description", ""), getattr(engine.source, "path", None))


def target_without_engine(options: EngineOptions) -> Target:
    """Resolve the model and the platform the way the engine would, without building one."""
    from podium.loader import resolve_model
    from podium_plugin_api import load_plugins

    config = options.config
    entry = load_plugins().select(config.device)
    caps = entry.platform.capabilities()
    dtype = caps.default_dtype if config.dtype == "auto" else _DTYPES[config.dtype]
    source = resolve_model(config.model, config.tokenizer)
    max_len = source.max_model_len if config.max_model_len is None else min(config.max_model_len,
                                                                            source.max_model_len)
    specials = list(source.eos_token_ids or []) + [getattr(source.hf_config, "bos_token_id", None)]
    space = TokenSpace.build(source.hf_config.vocab_size, max_len, source.tokenizer, specials)
    return Target(source.hf_config, space, dtype, entry.platform.torch_device(), entry.platform, entry.name,
                  getattr(source, "description", ""), getattr(source, "path", None))


def hf_backend(options: EngineOptions, target: Target, batch_size: int) -> HFBackend:
    config = options.config
    model = load_hf_model(config.model, target.dtype, target.device, config.seed, target.hf_config, target.path)
    tokenizer = target.space.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    pad = pad if pad is not None else getattr(target.hf_config, "pad_token_id", None)
    return HFBackend(model, target.device, batch_size, pad_token_id=int(pad) if pad is not None else 0,
                     synchronize=target.platform.synchronize)


def free_memory(platform: Any) -> None:
    """Collect a dropped backend's model and caches before building the next one (accelerators)."""
    gc.collect()
    platform.empty_cache()
