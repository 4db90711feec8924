"""The tool-parser interface: a model's output text -> content and tool calls, final or so far.

A parser reads the whole text so far and says what it shows: the content (text for the user) and
the calls, each with its name once complete and its arguments' JSON text as far as it arrived.
Every parser keeps one promise the streaming side relies on: while the text grows, ``content`` and
each call's ``arguments`` only ever grow too (a marker that may be starting is held back, an
arguments value is passed on as its raw JSON text). So ``ToolCallStream`` can stream the difference
between two parses, and the deltas add up to the non-streamed result exactly.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import ClassVar

from .partial_json import ObjectScan


@dataclass
class CallDraft:
    """A tool call as far as the text shows it."""

    name: str | None  # None until the name is complete
    arguments: str = ""  # the arguments' JSON text so far; only grows
    complete: bool = False


@dataclass
class TextParse:
    content: str
    calls: list[CallDraft] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str  # the text that is not a tool call ("" when there is none)
    calls: list[ToolCall]


class ToolParser:
    """Base of the parsers; subclasses set ``name`` and implement ``parse``."""

    name: ClassVar[str]
    # the markers are special tokens in the model family's tokenizer: detokenize without skipping them
    keeps_special_tokens: ClassVar[bool] = False

    def parse(self, text: str, final: bool) -> TextParse:
        """What ``text`` shows so far (``final``: the text is complete). Raises ``ValueError`` when
        the text turns out not to be well-formed tool calls."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    def extract(self, text: str) -> ExtractedToolCalls:
        """The non-streaming result: the calls, or the whole text as content if they are malformed."""
        try:
            parsed = self.parse(text, final=True)
            calls = [self._finished(draft) for draft in parsed.calls]
        except ValueError:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(parsed.content, calls)

    def _finished(self, draft: CallDraft) -> ToolCall:
        if draft.name is None or not draft.complete:
            raise ValueError("an unfinished tool call")
        if not isinstance(json.loads(draft.arguments), dict):
            raise ValueError("tool-call arguments must be a JSON object")
        return ToolCall(self.new_call_id(), draft.name, draft.arguments)


def draft_from_object(text: str, scan: ObjectScan, name_key: str = "name",
                      argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallDraft:
    """A call from a JSON object like ``{"name": ..., "arguments": {...}}`` (scanned so far)."""
    name = None
    if scan.complete(name_key):
        name = json.loads(scan.text_of(text, name_key))
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool call's {name_key!r} must be a non-empty string")
    key = next((k for k in argument_keys if k in scan.fields), None)
    if key is None:
        arguments = "{}" if scan.end is not None else ""
    else:
        raw = scan.text_of(text, key)
        if raw.startswith('"'):  # arguments given as a JSON string holding JSON: passed on once whole
            arguments = json.loads(raw) if scan.complete(key) else ""
        else:
            arguments = raw
    return CallDraft(name, arguments, complete=scan.end is not None)


def holdback(text: str, marker: str) -> int:
    """How much of ``text`` may be released while ``marker`` could still be starting at its end."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)
