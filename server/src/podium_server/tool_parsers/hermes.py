"""Hermes format (Qwen2.5, Qwen3, Hermes and many fine-tunes): content, then one or more

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first ``<tool_call>``; text between or after the calls is dropped.
"""

from __future__ import annotations

from .base import TextParse, ToolParser, draft_from_object, holdback
from .partial_json import scan_object, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> TextParse:
        start = text.find(START)
        if start < 0:
            return TextParse(text if final else text[:holdback(text, START)])
        parsed = TextParse(text[:start])
        while start >= 0:
            body = start + len(START)
            scan = scan_object(text, body)
            if skip_ws(text, body) == len(text):
                break  # the call's object has not started yet
            parsed.calls.append(draft_from_object(text, scan))
            if scan.end is None:
                break
            after = skip_ws(text, scan.end)
            if text.startswith(END, after):
                start = text.find(START, after + len(END))
            elif END.startswith(text[after:]):
                break  # the end marker is arriving (or the text ended without it)
            else:
                raise ValueError(f"expected {END} after a tool call")
        return parsed
