"""Reasoning parsers: split a thinking model's ``<think>...</think>`` section from its answer.

``--reasoning-parser NAME`` picks one. ``split(text, final)`` returns (reasoning, content) for the
text so far; both only grow while the text does (a tag that may be arriving is held back), so a
stream sends their differences and the pieces add up to the final split.

- ``deepseek_r1``: the output is reasoning until ``</think>`` (the opening ``<think>`` is usually in
  the prompt, so it is optional here); an output cut short before ``</think>`` is all reasoning.
- ``qwen3``: reasoning only if the output opens with ``<think>`` (with ``enable_thinking: false``
  Qwen3's template closes an empty think block in the prompt, and the output is all answer).

A constrained request's grammar applies to the answer after the reasoning: the server hands the
engine the parser's markers as token ids (``markers``), and the engine masks nothing until the
output has closed the section (``podium.structured.reasoning_gate``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from podium.sampling_params import ReasoningMarkers

from ..tool_parsers.base import holdback

THINK, END_THINK = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str]
    requires_open_tag: ClassVar[bool]

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None when there is no reasoning section, content) of the text so far."""
        start = len(text) - len(text.lstrip())
        if text.startswith(THINK, start):
            start += len(THINK)
        elif not final and THINK.startswith(text[start:]):
            return None, ""  # may be a <think> arriving
        elif self.requires_open_tag:
            return None, text
        else:
            start = 0
        end = text.find(END_THINK, start)
        if end < 0:
            return text[start:] if final else text[start:holdback(text, END_THINK)], ""
        return text[start:end], text[end + len(END_THINK):].lstrip()

    def markers(self, tokenizer: Any) -> ReasoningMarkers:
        """The section's markers as ``tokenizer``'s ids (one special token each in Qwen3's and DeepSeek
        R1's vocabularies), for the engine's grammar to start after."""
        def ids(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)
        return ReasoningMarkers(ids(THINK), ids(END_THINK), optional=self.requires_open_tag)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    requires_open_tag = False


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    requires_open_tag = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()
