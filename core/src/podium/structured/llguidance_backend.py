"""The second grammar backend: llguidance (JSON schema, regex, Lark grammars -> token bitmask)."""

from __future__ import annotations

import json
from typing import Any

import torch

from ..errors import InvalidParameter
from .backend import GrammarSpec, choice_regex, unsupported_feature


class LLGuidanceMatcher:
    """llguidance's matcher "stops" as soon as only EOS may follow (its mask then holds just EOS);
    it has terminated, as the interface means it, once it accepted that EOS."""

    def __init__(self, matcher: Any, fill: Any, eos_token_ids: frozenset[int]) -> None:
        self._matcher, self._fill, self._eos = matcher, fill, eos_token_ids
        self._ended = False

    _executor: Any = None  # one llguidance LLExecutor (its thread pool) for every step's fill

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._fill(self._matcher, bitmask, row)

    @classmethod
    def fill_bitmasks(cls, matchers: list[LLGuidanceMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Many rows at once, over llguidance's threads."""
        import llguidance
        import llguidance.torch
        if cls._executor is None:
            cls._executor = llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(cls._executor, [(m._matcher, row) for m, row in zip(matchers, rows)],
                                                     bitmask)

    def accept(self, token_id: int) -> bool:
        accepted = self._matcher.consume_token(token_id) and not self._matcher.is_error()
        self._ended = self._ended or (accepted and token_id in self._eos)
        return accepted

    @classmethod
    def accept_tokens(cls, matchers: list[LLGuidanceMatcher], tokens: list[int]) -> list[bool]:
        return [m.accept(t) for m, t in zip(matchers, tokens)]  # (llguidance has no batched consume)

    def is_terminated(self) -> bool:
        return self._ended

    def reset(self) -> None:
        self._matcher.reset()
        self._ended = False


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance  # lazily: only engines that constrain output pay for the import
        import llguidance.hf
        import llguidance.torch

        self._llg = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._eos = frozenset(eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)

    def _grammar(self, spec: GrammarSpec) -> str:
        matcher = self._llg.LLMatcher
        if spec.kind == "json":
            feature = unsupported_feature(json.loads(spec.text))
            if feature:
                raise InvalidParameter(f"the JSON schema uses {feature!r}, which structured output does not "
                                       "support", param="json_schema")
            return matcher.grammar_from_json_schema(spec.text, defaults={"whitespace_flexible": False})
        if spec.kind == "json_object":
            return matcher.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            return matcher.grammar_from_regex(choice_regex(json.loads(spec.text)))
        return matcher.grammar_from_lark(spec.text)

    def validate(self, spec: GrammarSpec) -> None:
        try:
            grammar = self._grammar(spec)
        except InvalidParameter:
            raise
        except Exception as exc:
            raise InvalidParameter(f"invalid {spec.kind}: {exc}", param=spec.kind) from None
        error = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)  # "" when valid
        if error:
            raise InvalidParameter(f"invalid {spec.kind}: {' '.join(error.split())}", param=spec.kind)

    def compile(self, spec: GrammarSpec) -> Any:
        """A matcher at the start of the grammar: building it builds the lexer (the slow part), so
        it is built here, off the step path, and each sequence gets a copy."""
        matcher = self._llg.LLMatcher(self.tokenizer, self._grammar(spec), log_level=1)
        if matcher.is_error():
            raise InvalidParameter(f"grammar rejected by llguidance: {matcher.get_error()}", param="structured_outputs")
        return matcher

    def matcher(self, compiled: Any) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self._fill, self._eos)
