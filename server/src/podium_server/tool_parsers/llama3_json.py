"""Llama 3.1 / 3.2 / 3.3 JSON format: the whole output is the call(s), optionally after ``<|python_tag|>``,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

several separated by ``;``. Output that does not start with ``{`` is plain content.
"""

from __future__ import annotations

from .base import TextParse, ToolParser, draft_from_object
from .partial_json import scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True  # <|python_tag|> is a special token of Llama 3

    def parse(self, text: str, final: bool) -> TextParse:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return TextParse("")  # nothing decided yet
        if i == len(text):
            return TextParse("" if not final else text)
        if text[i] != "{":
            return TextParse(text)
        parsed = TextParse("")
        while True:
            scan = scan_object(text, i)
            parsed.calls.append(draft_from_object(text, scan))
            if scan.end is None:
                return parsed
            i = skip_ws(text, scan.end)
            if i == len(text):
                return parsed
            if text[i] != ";":
                raise ValueError("calls must be separated by ';'")
            i = skip_ws(text, i + 1)
            if i == len(text):
                return parsed
