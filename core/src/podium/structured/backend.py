"""The grammar backend interface: what the engine asks of xgrammar, llguidance or any other.

A backend is built once per engine for one tokenizer (``GrammarBackend``). It checks a
``GrammarSpec`` cheaply on the caller's thread (``validate``: a bad schema or regex is the caller's
error, reported at once), compiles it against the vocabulary off the step path (``compile``, run in
a worker thread by ``GrammarService``), and makes one ``Matcher`` per sequence from the result.

A matcher follows one sequence's output: ``fill_bitmask`` writes the tokens allowed next into one
row of an int32 bitmask [rows, ceil(V / 32)] (bit ``t % 32`` of word ``t // 32`` set: token ``t``
allowed; both xgrammar and llguidance use this layout), ``accept`` advances it with the sampled
token. End-of-sequence tokens are allowed only where the grammar can end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import InvalidParameter
from ..sampling_params import StructuredOutputsParams

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint in a hashable form: ``kind`` (one of ``KINDS``) and ``text`` (a JSON schema as
    compact JSON in its own key order, which is the order properties are generated in; a regex, a JSON list of choices, an EBNF grammar, or "" for json_object)."""

    kind: str
    text: str

    @classmethod
    def from_params(cls, params: StructuredOutputsParams) -> GrammarSpec:
        try:
            kind = params.kind()
        except ValueError as exc:
            raise InvalidParameter(str(exc), param="structured_outputs") from None
        value = getattr(params, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise InvalidParameter(f"structured_outputs.json is not valid JSON: {exc}", "json") from None
            if not isinstance(value, dict | bool):
                raise InvalidParameter(f"structured_outputs.json must be a JSON schema object, got "
                                       f"{type(value).__name__}", param="json")
            return cls(kind, json.dumps(value, separators=(",", ":")))
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise InvalidParameter("structured_outputs.choice must be a non-empty list of strings", "choice")
            return cls(kind, json.dumps(value))
        if kind == "json_object":
            return cls(kind, "")
        if not isinstance(value, str) or not value:
            raise InvalidParameter(f"structured_outputs.{kind} must be a non-empty string", param=kind)
        return cls(kind, value)


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (each taken literally)."""
    return "(" + "|".join(_regex_literal(c) for c in choices) + ")"


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in "\\^$.|?*+()[]{}/-" else ch for ch in text)


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, host)."""

    @classmethod
    def fill_bitmasks(cls, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """``matchers[i].fill_bitmask(bitmask, rows[i])`` for every i, in one call (a library's own
        batched, threaded fill)."""

    def accept(self, token_id: int) -> bool:
        """Advance with ``token_id``; False if the grammar does not allow it (the state is unchanged)."""

    @classmethod
    def accept_tokens(cls, matchers: list[Matcher], tokens: list[int]) -> list[bool]:
        """``matchers[i].accept(tokens[i])`` for every i, in one call where the library has one."""

    def is_terminated(self) -> bool:
        """Whether the grammar has ended (an end-of-sequence token was accepted)."""

    def reset(self) -> None:
        """Back to the start of the output."""


class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer (vocabulary of ``vocab_size`` logits)."""

    name: str

    def validate(self, spec: GrammarSpec) -> None:
        """Raise ``InvalidParameter`` saying what is wrong with ``spec`` (cheap: no vocabulary work)."""

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of a valid ``spec`` (slow: runs in a worker thread)."""

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of the output."""


def unsupported_feature(schema: Any) -> str | None:
    """The first JSON-schema keyword in ``schema`` that no backend here enforces, or None. Naming it
    beats silently generating output that ignores it."""
    unsupported = {"patternProperties", "dependentSchemas", "dependentRequired", "if", "then", "else",
                   "not", "unevaluatedProperties", "unevaluatedItems", "contains", "propertyNames",
                   "$dynamicRef", "uniqueItems"}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in unsupported:
                    return key
                if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                    stack.extend(value.values())  # (their keys are names, not keywords)
                elif key not in ("enum", "const", "default", "examples", "description", "title"):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return None
