"""Bounds on a JSON request body: nesting depth, string length, array (and object) size.

Python's ``json`` parser recurses once per nesting level, so a body nested a few thousand levels
deep raises ``RecursionError`` (a 500) before any validation can look at it. The depth is
therefore measured before parsing, by a scan that never recurses: string literals are blanked
out (one C-speed regex pass; brackets inside strings do not nest), the remaining brackets become
+1 / -1 and the deepest prefix sum is the depth. Only a body within the depth limit is parsed;
the sizes are then checked by an iterative walk (no recursion either). Each violation is a 400
naming the limit and the flag that sets it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from .errors import APIError

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a string literal, escapes included
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class JsonLimits:
    max_depth: int = 64
    max_string_chars: int = 8 * 2**20
    max_array_items: int = 2**20  # also bounds an object's keys

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_string_chars", "max_array_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def json_depth(body: bytes) -> int:
    """How deep ``body``'s arrays and objects nest (0 for a scalar), counted without parsing.
    Unbalanced brackets count as they open (the parser refuses the body later)."""
    brackets = _STRING.sub(b'""', body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    # "[" 0x5B and "{" 0x7B have bit 2 clear, "]" 0x5D and "}" 0x7D have it set
    steps = 1 - 2 * ((codes >> 2) & 1).astype(np.int64)
    return int(np.cumsum(steps).max())


def check_json_body(body: bytes, limits: JsonLimits) -> APIError | None:
    """The first limit ``body`` breaks, as the error to answer; None if it keeps them all (or is
    not JSON at all: the handler's parser reports that)."""
    depth = json_depth(body)
    if depth > limits.max_depth:
        return _limit_error(f"The request body nests JSON {depth} levels deep; this server accepts at most "
                            f"{limits.max_depth} (--max-json-depth)", "json_too_deep")
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return _check_sizes(value, limits)


def _check_sizes(value: object, limits: JsonLimits) -> APIError | None:
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if len(item) > limits.max_string_chars:
                return _limit_error(f"The request body holds a string of {len(item)} characters; this server "
                                    f"accepts at most {limits.max_string_chars} (--max-json-string-chars)",
                                    "json_string_too_long")
        elif isinstance(item, (list, dict)):
            if len(item) > limits.max_array_items:
                kind = "an array of" if isinstance(item, list) else "an object with"
                return _limit_error(f"The request body holds {kind} {len(item)} items; this server accepts at "
                                    f"most {limits.max_array_items} (--max-json-array-items)", "json_array_too_long")
            if isinstance(item, dict):
                todo.extend(item.keys())
                todo.extend(v for v in item.values() if isinstance(v, (str, list, dict)))
            else:
                todo.extend(v for v in item if isinstance(v, (str, list, dict)))
    return None


def _limit_error(message: str, code: str) -> APIError:
    return APIError(400, message, code=code)
