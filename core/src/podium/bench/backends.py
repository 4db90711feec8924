"""Building the backends a benchmark compares, so that both see the same model, dtype and device.

A :class:`Target` is what Podium and transformers must agree on: the model's config, the token
space the datasets draw from, the dtype and the torch device. It comes from Podium's engine when
Podium runs (so ``--dtype auto`` means whatever the platform chose), else from Podium's model
resolver and platform selection without building an engine.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from .datasets import TokenSpace
from .hf_backend import HFBackend, load_hf_model
from .podium_backend import PodiumBackend

BACKENDS = ("podium", "hf")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineOptions:
    """The ``LLM`` options a benchmark passes through (None: the engine's default)."""

    model: str
    device: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    kv_cache_memory: str | None = None
    seed: int = 0
    async_scheduling: bool | None = None
    kv_cache_dtype: str = "auto"

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "device": self.device, "dtype": self.dtype, "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "enforce_eager": self.enforce_eager, "enable_prefix_caching": self.enable_prefix_caching,
            "kv_cache_memory": self.kv_cache_memory, "seed": self.seed, "async_scheduling": self.async_scheduling,
            "kv_cache_dtype": self.kv_cache_dtype,
        }


@dataclass
class Target:
    hf_config: Any
    space: TokenSpace
    dtype: torch.dtype
    device: torch.device
    platform_name: str
    description: str = ""
    path: str | None = None  # the file or folder the model was loaded from (None: a named shape)


def podium_backend(options: EngineOptions, detokenize: bool = True) -> PodiumBackend:
    return PodiumBackend.create(options.model, detokenize, **options.engine_kwargs())


def target_of(backend: PodiumBackend) -> Target:
    engine = backend.engine
    return Target(engine.source.hf_config, backend.token_space(), engine.dtype, engine.device, engine.platform_name,
                  getattr(engine.source, "description", ""), getattr(engine.source, "path", None))


def target_without_engine(options: EngineOptions) -> Target:
    """Resolve the model and the platform the way the engine would, without building one."""
    from podium.discovery import select_platform
    from podium.loader import resolve_model

    entry = select_platform(options.device)
    caps = entry.platform.capabilities()
    dtype = caps.default_dtype if options.dtype == "auto" else _DTYPES[options.dtype]
    source = resolve_model(options.model)
    max_len = source.max_model_len if options.max_model_len is None else min(options.max_model_len,
                                                                             source.max_model_len)
    specials = list(source.eos_token_ids or []) + [getattr(source.hf_config, "bos_token_id", None)]
    space = TokenSpace.build(source.hf_config.vocab_size, max_len, source.tokenizer, specials)
    return Target(source.hf_config, space, dtype, entry.platform.torch_device(), entry.name,
                  getattr(source, "description", ""), getattr(source, "path", None))


def hf_backend(options: EngineOptions, target: Target, batch_size: int) -> HFBackend:
    model = load_hf_model(options.model, target.dtype, target.device, options.seed, target.hf_config, target.path)
    tokenizer = target.space.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    pad = pad if pad is not None else getattr(target.hf_config, "pad_token_id", None)
    return HFBackend(model, target.device, batch_size, pad_token_id=int(pad) if pad is not None else 0)


def free_memory() -> None:
    """Collect a dropped backend's model and caches before building the next one (accelerators)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
