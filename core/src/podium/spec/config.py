"""``speculative_config``: which proposer drafts tokens and how many, as vLLM names the settings.

Given as a mapping (``LLM(speculative_config={...})``) or its JSON text (``--speculative-config``),
validated once into a frozen ``SpeculativeConfig``. Only the n-gram proposer is built here; the
other methods vLLM names are refused with the reason rather than silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
NOT_YET = {
    "draft_model": "a draft model proposer is not implemented yet; use method 'ngram'",
    "eagle": "EAGLE draft heads are not implemented yet; use method 'ngram'",
    "eagle3": "EAGLE-3 draft heads are not implemented yet; use method 'ngram'",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: tokens proposed (and verified) per sequence per step
    prompt_lookup_max: int = 4  # the longest suffix (n-gram) matched against earlier tokens
    prompt_lookup_min: int = 1  # the shortest one tried before giving up

    def __post_init__(self) -> None:
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config method {self.method!r}: {NOT_YET[self.method]}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")


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
