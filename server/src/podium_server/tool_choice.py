"""``tools`` and ``tool_choice``: which calls the model must make, enforced by a grammar.

- ``none``: the tools reach the chat template, the model answers in text.
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is that
  function's arguments, constrained by its ``parameters`` JSON schema; one call.
- ``required``: the output is a JSON array of ``{"name": ..., "parameters": {...}}`` objects, each
  item one of the tools with its own schema (at least one item; one at most when
  ``parallel_tool_calls`` is false). Like vLLM, so even a small model's calls parse and validate.
- ``auto``: the model chooses, which needs a tool-call parser to find calls in free text; without
  one (``--enable-auto-tool-choice --tool-call-parser``) it is a 400 naming the flags, as in vLLM.

The output becomes OpenAI ``tool_calls`` through a forced-call parser (``tool_parsers.forced``),
like a model format's: whole in a response; streamed in OpenAI's delta shape as the grammar
generates it (a call's index, id, type and name first, then its arguments in fragments).
"""

from __future__ import annotations

import json
from typing import Any

from podium.sampling_params import StructuredOutputsParams

from .errors import bad_request
from .protocol import ChatCompletionRequest
from .tool_parsers import ToolParser
from .tool_parsers.forced import NamedToolParser, RequiredToolsParser

AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict]:
    """The function definitions of ``tools`` by name (a 400 naming the first malformed one)."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                              param=where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                              param=f"{where}.function.parameters")
        functions[name] = {**function, "parameters": parameters}
    return functions


def tool_mode(req: ChatCompletionRequest, functions: dict[str, dict], auto_tool_choice: bool = False) -> \
        tuple[ToolParser | None, StructuredOutputsParams | None]:
    """The parser of a forced tool choice and the constraint that enforces it (both None: the model
    answers in text, or chooses its calls with ``auto``)."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None, None
    if not functions:
        raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "auto":
        if not auto_tool_choice:
            raise bad_request(AUTO_NEEDS_PARSER, param="tool_choice")
        return None, None
    if choice == "required":
        return RequiredToolsParser(), StructuredOutputsParams(json=required_schema(functions, req.parallel_tool_calls))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise bad_request(f"tool_choice names function {name!r}, which is not among the tools "
                              f"({', '.join(functions)})", param="tool_choice")
        return NamedToolParser(name), StructuredOutputsParams(json=functions[name]["parameters"])
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      f"{{'name': ...}}}}, got {choice!r}", param="tool_choice")


def required_schema(functions: dict[str, dict], parallel: bool | None) -> dict:
    """A JSON array of one or more calls, each ``{"name": <a tool>, "parameters": <its arguments>}``."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": f["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, f in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def template_messages(conversation: list[dict]) -> list[dict]:
    """Chat templates read a call's arguments as a mapping (``tool_call.arguments | tojson``), the API
    sends a JSON string: parse them (an unparsable string stays as it is)."""
    for message in conversation:
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass
    return conversation
