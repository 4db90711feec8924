"""``speculative_config``: which proposer drafts tokens and how many, as vLLM names the settings.

Given as a mapping (``LLM(speculative_config={...})``) or its JSON text (``--speculative-config``),
validated once into a frozen ``SpeculativeConfig``. Methods:

    ngram        prompt lookup in the sequence (and the request's predicted output); no model
    draft_model  a smaller model sharing the target's tokenizer (``model``), with its own KV cache
    eagle        an EAGLE-1 head (``model``: a folder with config.json + safetensors) over the
                 target's last hidden states, the target's embedding and lm_head reused
    eagle3       an EAGLE-3 head over three target layers' hidden states, its own reduced vocabulary

vLLM's names that mean something else here are refused with the reason, never silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # a second model (or head) on the device


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: tokens proposed (and verified) per sequence per step
    prompt_lookup_max: int = 4  # ngram: the longest suffix (n-gram) matched against earlier tokens
    prompt_lookup_min: int = 1  # ngram: the shortest one tried before giving up
    model: str | None = None  # draft_model / eagle / eagle3: a folder, a GGUF file, a name or a shape
    # the draft's ranks; only 1 (the draft runs on rank 0's device) is supported
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        method = self.method
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if method in MODEL_METHODS and not self.model:
            what = "a draft model sharing the target's tokenizer" if method == "draft_model" else \
                f"an {method.upper()} head checkpoint (a folder with config.json and safetensors)"
            raise ValueError(f"speculative_config method {method!r} needs 'model': {what}")
        if method == "ngram" and self.model:
            raise ValueError(f"speculative_config method 'ngram' takes no model (got model={self.model!r}); "
                             "use method 'draft_model' to draft with a model")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"speculative_config draft_tensor_parallel_size={self.draft_tensor_parallel_size!r}: "
                             "the draft runs unsharded on one device; use 1 (or leave it unset)")

    @property
    def uses_model(self) -> bool:
        return self.method in MODEL_METHODS


_NAMES = tuple(f.name for f in fields(SpeculativeConfig))


def speculative_config(value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
    """The validated config from a mapping, its JSON text, a config, or None (off)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not valid JSON ({exc}): {value!r}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be a mapping or its JSON text, got {value!r}")
    unknown = sorted(set(value) - set(_NAMES))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(_NAMES)})")
    if "method" not in value:
        raise ValueError(f"speculative_config needs a method ({', '.join(METHODS)})")
    return SpeculativeConfig(**value)
