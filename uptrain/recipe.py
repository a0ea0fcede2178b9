"""Uptraining recipes: the typed sections, YAML loading, ``key.sub=value`` overrides and validation.

A recipe is a commented YAML file (``recipes/*.yaml``) that maps one-to-one onto :class:`Recipe`. Each
field says what it means once, in its ``help`` metadata. Loading checks every key, type and cross-field
rule and reports *all* problems in one :class:`RecipeError`, each naming the key, the bad value and what
is allowed::

    recipe = load_recipe("recipes/smollm2-135m-mqa.yaml", ["train.lr=3e-4", "budget.steps=50"])

The ``model.convert`` section is :class:`gqakit.convert.ConvertOptions` itself (the options of
``gqakit convert``, checked by its own rules). Strings may refer to environment variables as ``${VAR}``
or ``${VAR:-default}``, and ``~`` is the home directory, so a shipped recipe can point into
``${GQAKIT_CACHE:-~/.cache/gqakit}``. What a recipe points at (files, the machine, the run directory) is
checked when a run starts (:mod:`gqakit.uptrain.preflight`). The sections, their field help and their
rules are :mod:`gqakit.uptrain.recipe_schema`.
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
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(tp, str(tp))


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _coerce(tp: Any, value: Any, key: str, problems: list[str]) -> Any:
    """Check ``value`` against type ``tp``; return it (converted where harmless) or record a problem."""
    if isinstance(value, str):
        value = expand(value)
    origin = typing.get_origin(tp)
    bad = f"{key}: expected {_describe(tp)}, got {value!r}"
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):  # a section: its own problems
                return _coerce(arg, value, key, problems)
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
        return _build(tp, value, key + ".", problems)
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
    if tp is str and not isinstance(value, str):
        problems.append(bad + ".")
        return None
    return value


def _build(cls: type, data: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    """``cls(**data)``, each value checked against its field's type; None when anything is missing."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    section = prefix.rstrip(".") or "the recipe"
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            hint = did_you_mean(str(key), names)
            problems.append(f"{prefix}{key}: unknown key.{hint} Known keys in {section}: {', '.join(names)}.")
            continue
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", problems)
    missing = [
        f
        for f in fields
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    for f in missing:
        what = f.metadata.get("gqakit", {}).get("help", "")
        problems.append(f"{prefix}{f.name} is required ({_describe(hints[f.name])}). {what}".rstrip())
    if missing or any(v is None and not _optional(hints[k]) for k, v in kwargs.items()):
        return None
    return cls(**kwargs)


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


def shipped_recipes() -> list[str]:
    return sorted(p.name for p in RECIPES_DIR.glob("*.yaml"))


def _find(path: str | Path) -> Path:
    p = Path(expand(str(path)))
    if p.is_file():
        return p
    for candidate in (RECIPES_DIR / p.name, RECIPES_DIR / f"{p.name}.yaml"):
        if p.parent == Path(".") and candidate.is_file():  # a bare shipped name: `smollm2-135m-mqa`
            return candidate
    known = ", ".join(shipped_recipes())
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
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise GqakitError(f"Recipe {file} is not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise GqakitError(f"Recipe {file} is not a UTF-8 text file.") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise GqakitError(
            f"Recipe {file} must be a YAML mapping of sections (model:, data:, ...), not a list or value."
        )
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
