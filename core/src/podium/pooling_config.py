"""How a pooling (embedding) model turns hidden states into one vector: the engine-level settings.

``runner`` says what the engine does with the model: ``"generate"`` text, ``"pooling"`` embeddings,
``"auto"`` decides by architecture (an encoder such as ``BertModel`` pools; a ``*ForCausalLM``
generates unless asked to pool). vLLM's spellings ``task="embed"`` / ``convert="embed"`` mean
``"pooling"``. ``PoolerConfig`` overrides what the model folder says (``podium.pooling``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

RUNNERS = ("auto", "generate", "pooling")
RUNNER_ALIASES = {"embed": "pooling", "embedding": "pooling", "encode": "pooling", "generation": "generate"}
POOLING_TYPES = ("MEAN", "CLS", "LAST")


@dataclass(frozen=True)
class PoolerConfig:
    """Overrides of the model's pooling (None: what its folder says, else the architecture's default).

    ``pooling_type``: MEAN (the average of the sequence's hidden states), CLS (the first token's),
    LAST (the last token's); ``normalize``: scale embeddings to unit length."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", kind)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}")


def pooler_config(value: PoolerConfig | Mapping[str, Any] | str | None) -> PoolerConfig | None:
    """A ``PoolerConfig`` from itself, a mapping of its fields, or their JSON (the CLI's form)."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"pooler_config: not JSON ({error}); e.g. '{{\"pooling_type\": \"MEAN\"}}'") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"pooler_config must be a PoolerConfig, a dict or JSON, got {type(value).__name__}")
    known = {f.name for f in fields(PoolerConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"pooler_config: unknown field(s) {unknown}; known: {sorted(known)}")
    return PoolerConfig(**value)


def runner_name(value: str) -> str:
    """``value`` as one of RUNNERS (vLLM's task/convert spellings accepted)."""
    name = RUNNER_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)} (or task='embed'), got {value!r}")
    return name
