"""Building the recipe's dataclasses from plain data (what YAML holds), collecting every problem: unknown
keys with a "did you mean", wrong types, missing required keys."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union

from gqakit.errors import did_you_mean

# ---------------------------------------------------------------------------------------------------
# Building dataclasses from plain data, collecting every problem.
# ---------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}s"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        type(None): "null",
    }.get(tp, str(tp))


def _coerce(tp: Any, value: Any, key: str, problems: list[str]) -> Any:
    """Check ``value`` against type ``tp``; return it (converted where harmless) or record a problem."""
    origin = typing.get_origin(tp)
    bad = f"{key}: expected {_describe(tp)}, got {value!r}"
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            trial: list[str] = []
            out = _coerce(arg, value, key, trial)
            if not trial:
                return out
        problems.append(bad + ".")
        return None
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = did_you_mean(str(value), [str(c) for c in choices])
            problems.append(
                f"{key}: {value!r} is not allowed.{hint} Choose one of {', '.join(map(str, choices))}."
            )
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            if item is str and isinstance(value, str):
                value = [value]  # a single path where a list of paths is expected
            else:
                problems.append(bad + ".")
                return None
        return [_coerce(item, v, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(bad + ".")
            return None
        return build(tp, value, key + ".", problems)
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(bad + ".")
        return value
    if tp in (int, float):
        # YAML reads 2e12 (no dot) as a string; accept numbers written that way.
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(bad + ".")
            return None
        if tp is int:
            if float(value).is_integer():
                return int(value)
            problems.append(bad + " (not a whole number).")
            return None
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(bad + ".")
            return None
        return value
    return value


def build(cls: type, data: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    section = prefix.rstrip(".") or "the recipe"
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            hint = did_you_mean(str(key), names)
            problems.append(f"{prefix}{key}: unknown key.{hint} Known keys in {section}: {', '.join(names)}.")
            continue
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", problems)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    for name in missing:
        problems.append(f"{prefix}{name} is required ({_describe(hints[name])}).")
    if missing or any(v is None and not _optional(hints[k]) for k, v in kwargs.items()):
        return None
    return cls(**kwargs)


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)
