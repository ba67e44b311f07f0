"""The checks behind config errors: a value against a field's type annotation, and messages
that name the field and spell values as config.json does."""

from __future__ import annotations

import json
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A config field is missing, inconsistent or unsupported; the message names the field."""


def check_fields(cls, values: dict[str, Any], positive=()) -> None:
    """Each field of the dataclass `cls` in `values` has its annotated type; those in `positive`
    are positive."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if not _matches(value, hints[name]):
            raise ConfigError(_wrong_type(name, value, hints[name]))
        if name in positive and value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {as_json(value)}")


def get_field(raw: dict[str, Any], name: str, hint, default=None, where: str = ""):
    """raw[name] checked against the type `hint`, or `default` when it is absent or null;
    `where` is the path of `raw` in config.json (e.g. "rope_scaling.")."""
    value = raw.get(name)
    if value is None:
        return default
    if not _matches(value, hint):
        raise ConfigError(_wrong_type(where + name, value, hint))
    return value


def _matches(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, arg) for arg in args)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return is_int(value)
    if hint is float:  # JSON writes 10000.0 as 10000
        return is_int(value) or isinstance(value, float)
    if origin in (tuple, list):
        return isinstance(value, origin) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_matches(v, args[1]) for v in value.values())
    return isinstance(value, hint)


def _wrong_type(name: str, value, hint) -> str:
    return f"{name} must be {_describe(hint)}, got {as_json(value)}"


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(arg) for arg in args)
    if origin in (tuple, list):
        return f"a list of {_plural(args[0])}"
    if origin is dict:
        return "an object" if args[1] is Any else f"an object of {_plural(args[1])}"
    words = {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string",
             dict: "an object"}
    return words[hint] if hint in words else hint.DESCRIPTION


def _plural(hint) -> str:
    return _describe(hint).split(" ", 1)[1] + "s"  # "an integer" -> "integers"


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a count


def as_json(value) -> str:
    """A value as config.json spells it (true, null, "abc"), cut short."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."
