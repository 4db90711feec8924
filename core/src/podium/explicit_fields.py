"""Which fields of a settings object its caller set, so that defaults from elsewhere never override them.

A platform's suggested ``block_size`` or a model's ``generation_config.json`` temperature fills a
field only where the user left it unset; comparing with the dataclass default cannot tell "left
unset" from "set to the default value" (``LLM(block_size=16)`` on a platform that suggests 64).
So a dataclass decorated with ``@remembers_explicit_fields`` records, at construction, the fields
its constructor was given a value other than None (None means "choose for me" throughout).

``with_fallbacks(obj, values)`` is the one way to fill the others: a copy whose explicit fields are
still the caller's. ``dataclasses.replace`` passes every field to the constructor, so its result
counts every field as explicit: the safe direction (nothing gets overridden).
"""

from __future__ import annotations

import functools
from dataclasses import fields, replace
from typing import Any, TypeVar

T = TypeVar("T")
_ATTR = "_explicit_fields"


def remembers_explicit_fields(cls: type[T]) -> type[T]:
    """Class decorator for a dataclass (frozen or not): instances remember their explicit fields."""
    init = cls.__init__
    names = [f.name for f in fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        given = {name for name, value in zip(names, args) if value is not None}
        given.update(name for name, value in kwargs.items() if value is not None)
        object.__setattr__(self, _ATTR, frozenset(given))

    cls.__init__ = __init__
    return cls


def explicit_fields(obj: Any) -> frozenset[str]:
    """The fields ``obj``'s constructor was given (not None)."""
    return getattr(obj, _ATTR, frozenset())


def with_fallbacks(obj: T, values: dict[str, Any]) -> T:
    """A copy of ``obj`` with ``values`` in the fields its caller did not set (unknown names are
    skipped); the copy's explicit fields stay ``obj``'s."""
    given = explicit_fields(obj)
    known = {f.name for f in fields(obj) if f.init}
    updates = {k: v for k, v in values.items() if k in known and k not in given}
    if not updates:
        return obj
    new = replace(obj, **updates)
    object.__setattr__(new, _ATTR, given)
    return new
