"""Tool-call parsers: each turns one model family's tool-call format into OpenAI tool calls.

``--tool-call-parser NAME`` picks one (``TOOL_PARSERS``); with ``--enable-auto-tool-choice`` the
chat endpoints parse every output of a request that has tools and ``tool_choice: "auto"``.
"""

from __future__ import annotations

from .base import ExtractedToolCalls, ToolCall, ToolParser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser
from .pythonic import PythonicToolParser
from .stream import StreamDelta, ToolCallDelta, ToolCallStream

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "StreamDelta", "ToolCall", "ToolCallDelta", "ToolCallStream",
           "ToolParser", "get_tool_parser"]
