"""Uptraining recipes: YAML loading, ``key.sub=value`` overrides and validation (the typed sections, their
field help and rules are :mod:`gqakit.uptrain.recipe_schema`).

Loading reports *all* problems (keys, types, cross-field rules) in one :class:`RecipeError`. Strings may
use ``${VAR}``, ``${VAR:-default}`` and ``~``. What a recipe points at is checked when a run starts
(:mod:`gqakit.uptrain.preflight`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from gqakit.errors import GqakitError, did_you_mean
from gqakit.text import read_text_file
from gqakit.uptrain.recipe_schema import Recipe

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class RecipeError(GqakitError):
    """One or more problems with a recipe, all reported at once."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        head = f"Recipe {source} has {len(problems)} problem{'s' if len(problems) > 1 else ''}:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in problems)]))


# -------------------------------- Plain data (what YAML holds) -> the dataclasses, collecting every problem

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (Union, types.UnionType):
        return " or ".join(map(_describe, args))
    if origin is list:
        return f"a list of {_describe(args[0])}s"
    return "a mapping (section)" if dataclasses.is_dataclass(tp) else _SCALARS.get(tp, str(tp))


def _coerce(tp: Any, value: Any, key: str, problems: list[str]) -> Any:
    """Check ``value`` against type ``tp``; return it (converted where harmless) or record a problem."""
    if isinstance(value, str):
        value = expand(value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = f"{key}: expected {_describe(tp)}, got {value!r}."
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            trial: list[str] = []
            out = _coerce(arg, value, key, trial)
            if not trial or (dataclasses.is_dataclass(arg) and isinstance(value, dict)):  # a section's own
                problems += trial
                return out
    elif origin is Literal:
        if value not in args:
            hint = did_you_mean(str(value), [str(c) for c in args])
            problems.append(
                f"{key}: {value!r} is not allowed.{hint} Choose one of {', '.join(map(str, args))}."
            )
        return value
    elif origin is list:
        if isinstance(value, str) and args[0] is str:
            value = [value]  # a single path where a list of paths is expected
        if isinstance(value, list):
            return [_coerce(args[0], v, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, key + ".", problems)
    elif tp in (int, float):
        # YAML reads 2e12 (no dot) as a string; accept numbers written that way.
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            value = float(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            if tp is float or float(value).is_integer():
                return tp(value)
            bad = bad[:-1] + " (not a whole number)."
    elif isinstance(value, tp):  # bool, str
        return value
    problems.append(bad)
    return None


def _build(cls: type, data: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    """``cls(**data)``, each value checked against its field's type; None when anything is missing."""
    hints, before = typing.get_type_hints(cls), len(problems)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    section = prefix.rstrip(".") or "the recipe"
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            hint = did_you_mean(str(key), names)
            problems.append(f"{prefix}{key}: unknown key.{hint} Known keys in {section}: {', '.join(names)}.")
        else:
            kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", problems)
    missing = dataclasses.MISSING
    for f in fields:
        if f.name not in data and f.default is missing and f.default_factory is missing:
            what = f.metadata.get("gqakit", {}).get("help", "")
            problems.append(f"{prefix}{f.name} is required ({_describe(hints[f.name])}). {what}".rstrip())
    return cls(**kwargs) if len(problems) == before else None


# ------------------------------------------------------------------------------------ Loading and overrides

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand(text: str) -> str:
    """``${VAR}`` and ``${VAR:-default}`` from the environment, then a leading ``~``."""
    out = _ENV.sub(lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), text)
    return os.path.expanduser(out)


def apply_overrides(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...], problems: list[str]
) -> None:
    """Apply ``key.sub=value`` overrides in place; values are YAML (``[a, b]``, ``null``, ``3e-4``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} is not key=value (e.g. train.lr=3e-4).")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section.")
                break
            node = child
        else:
            node[parts[-1]] = value


def read_mapping(path: str | Path, what: str, of: str) -> dict[str, Any]:
    """The YAML mapping (of ``of``) in the file ``path``, which messages call ``what``; empty: ``{}``."""
    try:
        data = yaml.safe_load(read_text_file(path, what))
    except yaml.YAMLError as e:
        raise GqakitError(f"{what} {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict | None):
        raise GqakitError(f"{what} {path} must be a YAML mapping of {of}, not a list or value.")
    return data or {}


def _find(path: str | Path) -> Path:
    p = Path(expand(str(path)))
    if p.is_file():
        return p
    for candidate in (RECIPES_DIR / p.name, RECIPES_DIR / f"{p.name}.yaml"):
        if p.parent == Path(".") and candidate.is_file():  # a bare shipped name: `smollm2-135m-mqa`
            return candidate
    known = ", ".join(sorted(p.name for p in RECIPES_DIR.glob("*.yaml")))
    what = "is a directory" if p.is_dir() else "does not exist"
    raise GqakitError(f"Recipe {path} {what}. Give a YAML file; shipped recipes ({RECIPES_DIR}): {known}.")


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe, apply overrides, and validate everything at once.

    Args:
        path: a YAML file, or the name of a shipped recipe (``smollm2-135m-mqa``).
        overrides: ``key.sub=value`` strings, applied in order after the file.

    Raises:
        GqakitError: the file is missing or not YAML.
        RecipeError: any unknown key, wrong type or invalid value, all listed.
    """
    file = _find(path)
    data = read_mapping(file, "Recipe", "sections (model:, data:, ...)")
    return recipe_from_dict(data, overrides, source=str(file))


def recipe_from_dict(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str = "<dict>"
) -> Recipe:
    """Build and validate a :class:`Recipe` from plain data (what the YAML file holds)."""
    problems: list[str] = []
    data = copy.deepcopy(data)  # overrides write into nested sections: never into the caller's dicts
    apply_overrides(data, overrides, problems)
    recipe = _build(Recipe, data, "", problems)
    if recipe is not None and not problems:
        problems.extend(recipe.problems())
    if problems:
        raise RecipeError(source, problems)
    return recipe
