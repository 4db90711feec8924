"""Typed platform options: each platform declares its settings; the core validates them once.

A platform lists ``PlatformOption``s from ``Platform.options()`` (name, type, default, help, and
optionally the allowed values, a parser for a richer syntax, and an environment variable accepted
as an alias). Users set them with ``podium serve --platform-option NAME=VALUE`` (repeated),
``LLM(platform_options={...})`` or the alias; ``podium platforms --verbose`` lists them. The engine
resolves them with ``resolve_options`` when it starts (explicit values first, then the alias, then
the default) and hands the result to ``Platform.activate``: validated, typed, read-only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

OPTION_TYPES = (bool, int, float, str)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class PlatformOption:
    """One setting a platform accepts.

    ``type`` is bool, int, float or str; a value arriving as text (the CLI, the alias) is converted to
    it. ``choices``: the allowed values (str options). ``parse``: for a richer syntax, takes the typed
    value and returns what the platform reads (raising ValueError that says what is allowed).
    ``env``: an environment variable read when the option is not given explicitly (an alias).
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    env: str | None = None
    parse: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.type not in OPTION_TYPES:
            raise TypeError(f"platform option {self.name!r}: type must be one of bool, int, float, str, "
                            f"got {self.type!r}")
        if self.choices and self.type is not str:
            raise TypeError(f"platform option {self.name!r}: choices need type str")

    def convert(self, value: Any, parsed: bool = True) -> Any:
        """``value`` (typed, or text) as this option's type, checked against ``choices`` and ``parse``
        (and parsed, unless ``parsed`` is False); ValueError naming the allowed values otherwise."""
        typed = _as_type(self.type, value)
        if self.choices:
            typed = self._choice(typed)
        if self.parse is None:
            return typed
        result = self.parse(typed)
        return result if parsed else typed

    def _choice(self, text: str) -> str:
        """The allowed value ``text`` names, ignoring case and surrounding blanks."""
        for choice in self.choices:
            if text.strip().lower() == choice.lower():
                return choice
        raise ValueError(f"{text!r} is not allowed; choose one of {', '.join(self.choices)}")


def _as_type(kind: type, value: Any) -> Any:
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is bool:
        text = str(value).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError(f"{value!r} is not a switch; use one of 1/0, true/false, yes/no, on/off")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{value!r} is not text")
    try:
        return kind(str(value).strip())
    except ValueError:
        raise ValueError(f"{value!r} is not {'an integer' if kind is int else 'a number'}") from None


def resolve_options(platform: str, declared: Iterable[PlatformOption], given: Mapping[str, Any] | None = None,
                    environ: Mapping[str, str] | None = None, parsed: bool = True) -> Mapping[str, Any]:
    """Every declared option's value for ``platform``: from ``given``, else its alias in ``environ``
    (``os.environ`` by default), else its default. A read-only mapping. ``parsed=False`` keeps the
    values as typed, before an option's ``parse`` (for showing them; they are validated all the same).

    An unknown name, or a value that does not convert, is a ValueError naming the option (or the
    alias), the platform and what is allowed."""
    options = {o.name: o for o in declared}
    given = dict(given or {})
    environ = os.environ if environ is None else environ
    unknown = sorted(set(given) - set(options))
    if unknown:
        known = ", ".join(sorted(options)) or "none"
        raise ValueError(f"platform {platform!r} has no option {', '.join(map(repr, unknown))}; its options: {known}")
    values = {}
    for name, option in options.items():
        if name in given:
            where = f"platform option {name}={given[name]!r} ({platform!r})"
            values[name] = _checked(option, given[name], where, parsed)
        elif option.env and environ.get(option.env, "").strip():
            text = environ[option.env]
            where = f"{option.env}={text!r} (the alias of platform {platform!r}'s option {name!r})"
            values[name] = _checked(option, text, where, parsed)
        else:
            values[name] = option.parse(option.default) if parsed and option.parse is not None else option.default
    return MappingProxyType(values)


def _checked(option: PlatformOption, value: Any, where: str, parsed: bool) -> Any:
    try:
        return option.convert(value, parsed)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def parse_option_pairs(pairs: Iterable[str]) -> dict[str, str]:
    """``["attention=native", ...]`` (the CLI's repeated ``--platform-option``) -> ``{"attention": "native"}``."""
    values: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--platform-option takes NAME=VALUE, got {pair!r}")
        if name in values:
            raise ValueError(f"--platform-option {name} is given twice")
        values[name] = value.strip()
    return values
