"""Where JSON values start and end in text that may still be growing (a model's output so far).

A streaming tool parser needs to know, at every token, how much of a call's ``"arguments"`` value
has arrived: ``value_end`` says where a value ends, or None while it is incomplete; ``scan_object``
lists an object's top-level fields as (start, end) spans. Malformed JSON raises ``ValueError`` (the
text is then not a tool call after all).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}
# the scans below run on the whole text at every token: their loops jump with C-speed regexes
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*')  # a string's characters up to its closing quote
_STRUCTURE = re.compile(r'["{}\[\]]')  # what matters inside a container


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at ``text[i] == '"'``, None if it is not closed yet."""
    j = _STRING_BODY.match(text, i + 1).end()
    return j + 1 if j < len(text) and text[j] == '"' else None


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``i``; None while it may still grow."""
    if i >= len(text):
        return None
    ch = text[i]
    if ch == '"':
        return string_end(text, i)
    if ch in _CLOSE:
        stack, j = [_CLOSE[ch]], i + 1
        while (found := _STRUCTURE.search(text, j)) is not None:
            j, c = found.start(), found.group()
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in _CLOSE:
                stack.append(_CLOSE[c])
            elif c != stack.pop():
                raise ValueError(f"unbalanced {c!r} at offset {j}")
            elif not stack:
                return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    if j == len(text):
        return None  # a number or literal that may go on
    if j == i:
        raise ValueError(f"expected a JSON value at offset {i}, got {ch!r}")
    return j


@dataclass
class ObjectScan:
    """The fields of a (possibly incomplete) JSON object: key -> (value start, value end or None)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # past the closing brace, once it arrived

    def text_of(self, text: str, key: str) -> str | None:
        """The raw text of ``key``'s value so far (None if the key has not arrived)."""
        if key not in self.fields:
            return None
        start, end = self.fields[key]
        return text[start:end] if end is not None else text[start:]

    def complete(self, key: str) -> bool:
        return key in self.fields and self.fields[key][1] is not None


def scan_object(text: str, i: int) -> ObjectScan:
    """The fields of the object whose ``{`` is at ``i`` (whitespace before it is skipped)."""
    scan = ObjectScan()
    i = skip_ws(text, i)
    if i >= len(text):
        return scan
    if text[i] != "{":
        raise ValueError(f"expected '{{' at offset {i}, got {text[i]!r}")
    i = skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != '"':
            raise ValueError(f"expected a key at offset {i}, got {text[i]!r}")
        key_end = string_end(text, i)
        if key_end is None:
            return scan
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            raise ValueError(f"expected ':' after key {key!r}")
        start = skip_ws(text, i + 1)
        end = value_end(text, start)
        scan.fields[key] = (start, end)
        if end is None:
            return scan
        i = skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(text, i + 1)
        elif i < len(text) and text[i] != "}":
            raise ValueError(f"expected ',' or '}}' at offset {i}, got {text[i]!r}")
    return scan
