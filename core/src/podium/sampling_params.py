"""How to sample one request's continuation; shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidParameter
from .explicit_fields import remembers_explicit_fields

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what the sampler's integer tensors hold
_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed")


@dataclass(frozen=True)
class ReasoningMarkers:
    """A thinking model's reasoning section, as token ids: ``start`` opens it (``<think>``), ``end``
    closes it (``</think>``). ``optional``: an output reasons only if it opens with ``start`` (Qwen3's
    parser); else an output the prompt leaves no answer to yet is reasoning until ``end`` (DeepSeek R1's)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    optional: bool = False

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            ids = tuple(int(t) for t in getattr(self, name))
            if not ids:
                raise ValueError(f"reasoning markers: {name} needs at least one token id")
            object.__setattr__(self, name, ids)


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output, as vLLM names it: exactly one of ``json`` (a JSON schema, dict or
    string), ``regex``, ``choice`` (a list of strings), ``grammar`` (xgrammar's EBNF, llguidance's
    Lark) or ``json_object`` (any JSON object); ``podium.structured`` enforces it. ``backend`` picks the grammar backend (None: the engine's default).

    ``reasoning``: the constraint applies to the answer after a reasoning section (a server's
    reasoning parser gives its markers): no mask while the model reasons, the grammar from the token
    after the end marker (``podium.structured.reasoning_gate``). None: from the first output token."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    reasoning: ReasoningMarkers | None = None

    def kind(self) -> str:
        """The one constraint given (raises ValueError naming the fields when none or several are)."""
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        return given[0]


@remembers_explicit_fields
@dataclass
class SamplingParams:
    """Fields the caller leaves unset (or None) may take the model's generation_config.json defaults
    (``EngineConfig.generation_config``): temperature, top_p, top_k, min_p, repetition_penalty and
    max_tokens (its max_new_tokens)."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # <= 0: off (vLLM's -1 accepted too)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is added)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # the expected output (OpenAI's Predicted Outputs), text or token ids: with n-gram speculation
    # its continuations are proposed where the output matches it; otherwise it changes nothing
    prediction: str | list[int] | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> InvalidParameter:
            return InvalidParameter(f"{name} {rule}, got {getattr(self, name)!r}", param=name)

        self._check_int64()
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an integer, -1 or 0 (off) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "must be an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not s for s in self.stop):
            raise InvalidParameter("stop must not contain empty strings", param="stop")

    def _check_int64(self) -> None:
        """Every integer a step puts in a tensor fits int64: a larger one is the caller's error
        here, never an overflow inside a step (which would fail the whole batch)."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                raise InvalidParameter(f"{name} must fit in a signed 64-bit integer, got {value}", param=name)
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ())):
            bad = [t for t in ids if not INT64_MIN <= t <= INT64_MAX]
            if bad:
                raise InvalidParameter(f"{name} has token id(s) that do not fit in 64 bits: {bad[:3]}", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
