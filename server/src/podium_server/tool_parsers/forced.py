"""Parsers for outputs a grammar forced into a tool call (not model formats; not in the registry).

When the client names the tool (Anthropic's ``{"type": "tool"}``), the grammar is the tool's input
schema and the whole output is the arguments object. When it only requires some tool (``{"type":
"any"}``), the grammar is ``{"name": ..., "input": {...}}`` over the tools (``any_tool_schema``).
"""

from __future__ import annotations

from .base import CallDraft, TextParse, ToolParser, draft_from_object
from .partial_json import scan_object, skip_ws, value_end


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name

    def parse(self, text: str, final: bool) -> TextParse:
        start = skip_ws(text, 0)
        end = value_end(text, start)
        arguments = text[start:end] if end is not None else text[start:]
        return TextParse("", [CallDraft(self.tool_name, arguments, complete=end is not None)])


class AnyToolParser(ToolParser):
    name = "any"

    def parse(self, text: str, final: bool) -> TextParse:
        scan = scan_object(text, 0)
        return TextParse("", [draft_from_object(text, scan, argument_keys=("input",))])


def any_tool_schema(tools: list[tuple[str, dict]]) -> dict:
    """A JSON schema of one call of any of ``tools`` ((name, input schema) pairs), the name first."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "input": schema},
                       "required": ["name", "input"], "additionalProperties": False} for name, schema in tools]}
