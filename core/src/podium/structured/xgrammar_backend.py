"""The default grammar backend: xgrammar (JSON schema, regex, EBNF, builtin JSON -> token bitmask)."""

from __future__ import annotations

import json
from typing import Any

import torch

from ..errors import InvalidParameter
from .backend import GrammarSpec, choice_regex, unsupported_feature


class XGrammarMatcher:
    _batch: Any = None  # one xgrammar BatchGrammarMatcher (its thread pool) for every step's fill

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @classmethod
    def fill_bitmasks(cls, matchers: list[XGrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Many rows at once, over xgrammar's threads: at batch 256 the row-by-row fill is most of
        structured output's cost per step."""
        if cls._batch is None:
            import xgrammar as xgr
            cls._batch = xgr.BatchGrammarMatcher()
        cls._batch.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask, rows)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    @classmethod
    def accept_tokens(cls, matchers: list[XGrammarMatcher], tokens: list[int]) -> list[bool]:
        import xgrammar as xgr
        return xgr.BatchGrammarMatcher.batch_accept_token([m._matcher for m in matchers], tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def reset(self) -> None:
        self._matcher.reset()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr  # lazily: only engines that constrain output pay for the import

        self._xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_token_ids) or None)
        # our own cache (GrammarService) keys by spec; xgrammar's would hold every grammar twice
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)

    def _grammar(self, spec: GrammarSpec) -> Any:
        xgr = self._xgr
        if spec.kind == "json":
            feature = unsupported_feature(json.loads(spec.text))
            if feature:
                raise InvalidParameter(f"the JSON schema uses {feature!r}, which structured output does not "
                                       "support", param="json_schema")
            return xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":  # an object (OpenAI's json_object), not any JSON value
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            return xgr.Grammar.from_regex(choice_regex(json.loads(spec.text)))
        return xgr.Grammar.from_ebnf(spec.text)

    def validate(self, spec: GrammarSpec) -> None:
        try:
            self._grammar(spec)
        except InvalidParameter:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the parser's message
            raise InvalidParameter(f"invalid {_NAMES[spec.kind]}: {_first_line(exc)}", param=spec.kind) from None

    def compile(self, spec: GrammarSpec) -> Any:
        return self._compiler.compile_grammar(self._grammar(spec))

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar (EBNF)",
          "json_object": "json_object"}


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
