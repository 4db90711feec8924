"""Mistral formats: content, then ``[TOOL_CALLS]`` and either a JSON list (v3 tokenizers)

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

or, from the v11 tokenizers on, one ``[TOOL_CALLS]name[ARGS]{...}`` per call. Call ids are nine
letters and digits, as Mistral's chat template requires of the ids it gets back.
"""

from __future__ import annotations

import secrets
import string

from .base import CallDraft, TextParse, ToolParser, draft_from_object, holdback
from .partial_json import scan_object, skip_ws, value_end

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens of Mistral's tokenizers

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def parse(self, text: str, final: bool) -> TextParse:
        start = text.find(MARKER)
        if start < 0:
            return TextParse(text if final else text[:holdback(text, MARKER)])
        parsed = TextParse(text[:start])
        i = skip_ws(text, start + len(MARKER))
        if i < len(text) and text[i] == "[":
            self._json_list(text, i, parsed)
        else:
            self._named_calls(text, start, parsed)
        return parsed

    @staticmethod
    def _json_list(text: str, i: int, parsed: TextParse) -> None:
        i = skip_ws(text, i + 1)
        while i < len(text):
            scan = scan_object(text, i)
            parsed.calls.append(draft_from_object(text, scan))
            if scan.end is None:
                return
            i = skip_ws(text, scan.end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
            elif i < len(text) and text[i] == "]":
                return
            elif i < len(text):
                raise ValueError("expected ',' or ']' between Mistral tool calls")

    @staticmethod
    def _named_calls(text: str, marker: int, parsed: TextParse) -> None:
        while marker >= 0:
            name_start = marker + len(MARKER)
            args = text.find(ARGS, name_start)
            if args < 0:
                return  # the name is still arriving
            name = text[name_start:args].strip()
            if not name or any(ch in name for ch in "{}[]\" "):
                raise ValueError(f"bad Mistral tool name {name!r}")
            value = skip_ws(text, args + len(ARGS))
            end = value_end(text, value)
            parsed.calls.append(CallDraft(name, text[value:end] if end is not None else text[value:], end is not None))
            if end is None:
                return
            marker = text.find(MARKER, end)
