"""Pythonic format (Llama 3.2 / Llama 4 / ToolACE style): the output is a Python list of calls,

    [get_weather(city="Paris"), get_time(timezone="UTC")]

with literal keyword arguments. A call's name streams once its ``(`` arrives; its arguments (turned
into a JSON object) once its ``)`` does. Output that does not start with ``[`` is plain content.
"""

from __future__ import annotations

import ast
import json
import re

from .base import CallDraft, TextParse, ToolParser
from .partial_json import skip_ws

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_OPEN, _CLOSE = "([{", ")]}"


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> TextParse:
        i = skip_ws(text, 0)
        if i == len(text):
            return TextParse(text if final else "")
        if text[i] != "[":
            return TextParse(text)
        parsed = TextParse("")
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] != "]":
            match = _NAME.match(text, i)
            if match is None:
                raise ValueError(f"expected a function call at offset {i}")
            paren = skip_ws(text, match.end())
            if paren == len(text):
                return parsed  # the name may go on
            if text[paren] != "(":
                raise ValueError(f"expected '(' after {match.group()!r}")
            end = _call_end(text, paren)
            if end is None:
                parsed.calls.append(CallDraft(match.group()))
                return parsed
            parsed.calls.append(CallDraft(match.group(), _arguments(text[i:end]), complete=True))
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
            elif i < len(text) and text[i] != "]":
                raise ValueError("expected ',' or ']' between calls")
        return parsed


def _call_end(text: str, i: int) -> int | None:
    """End (exclusive) of the bracketed span opening at ``text[i]``, aware of Python string literals."""
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch in "'\"":
            j = _python_string_end(text, j)
            if j is None:
                return None
            continue
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _python_string_end(text: str, i: int) -> int | None:
    quote, j = text[i], i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == quote:
            return j + 1
        else:
            j += 1
    return None


def _arguments(call: str) -> str:
    try:
        node = ast.parse(call, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            raise ValueError("only keyword arguments are allowed")
        values = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except SyntaxError as exc:
        raise ValueError(f"not a Python call: {exc}") from None
    return json.dumps(values, ensure_ascii=False)
