"""Parsers for outputs a grammar forced into a tool call (not model formats; not in the registry).

When the client names the tool (OpenAI's named function, Anthropic's ``{"type": "tool"}``), the
grammar is the tool's input schema and the whole output is the arguments object. When it only
requires some tool, the grammar is Anthropic's ``{"name": ..., "input": {...}}`` over the tools
(``any_tool_schema``), or for OpenAI's ``tool_choice: "required"`` vLLM's JSON array of
``{"name": ..., "parameters": {...}}`` calls (``podium_server.tool_choice.required_schema``).
Like the model formats' parsers they read the text so far, so the calls stream as the grammar
generates them: id and name first, then argument fragments.
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


class RequiredToolsParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> TextParse:
        parsed = TextParse("")
        i = skip_ws(text, 0)
        if i == len(text):
            return parsed
        if text[i] != "[":
            raise ValueError(f"expected '[' at offset {i}, got {text[i]!r}")
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] != "]":
            scan = scan_object(text, i)
            parsed.calls.append(draft_from_object(text, scan, argument_keys=("parameters",)))
            if scan.end is None:
                return parsed
            i = skip_ws(text, scan.end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
            elif i < len(text) and text[i] != "]":
                raise ValueError(f"expected ',' or ']' between tool calls at offset {i}, got {text[i]!r}")
        return parsed


def any_tool_schema(tools: list[tuple[str, dict]]) -> dict:
    """A JSON schema of one call of any of ``tools`` ((name, input schema) pairs), the name first."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "input": schema},
                       "required": ["name", "input"], "additionalProperties": False} for name, schema in tools]}
