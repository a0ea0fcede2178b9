"""Uptraining recipes: YAML loading, ``key.sub=value`` overrides, validation.

A recipe is a commented YAML file (``recipes/*.yaml``) that maps one-to-one onto :class:`Recipe`
(:mod:`gqakit.uptrain.recipe_schema`). Loading it checks every key and type and every cross-field rule,
and reports *all* problems in one :class:`RecipeError`, each naming the key, the bad value and what is
allowed::

    recipe = load_recipe("recipes/smollm2-135m-mqa.yaml", ["train.lr=3e-4", "budget.steps=50"])

Strings may refer to environment variables as ``${VAR}`` or ``${VAR:-default}``, and ``~`` is the home
directory, so a shipped recipe can point into ``${GQAKIT_CACHE:-~/.cache/gqakit}``.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import yaml

from gqakit.errors import GqakitError
from gqakit.uptrain.recipe_checks import recipe_problems
from gqakit.uptrain.recipe_coerce import build
from gqakit.uptrain.recipe_schema import (
    BudgetConfig,
    CheckpointConfig,
    ConvertConfig,
    DataConfig,
    EvalConfig,
    GuardConfig,
    LogConfig,
    ModelConfig,
    ObjectiveConfig,
    Recipe,
    RecipeError,
    TrainConfig,
)

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand(text: str) -> str:
    """``${VAR}`` and ``${VAR:-default}`` from the environment, then a leading ``~``."""
    out = _ENV.sub(lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), text)
    return os.path.expanduser(out)


def _expand_all(value: Any) -> Any:
    if isinstance(value, str):
        return expand(value)
    if isinstance(value, list):
        return [_expand_all(v) for v in value]
    if isinstance(value, dict):
        return {k: _expand_all(v) for k, v in value.items()}
    return value


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
    data = _expand_all(data)
    recipe = build(Recipe, data, "", problems)
    if recipe is not None and not problems:
        problems.extend(recipe_problems(recipe))
    if problems:
        raise RecipeError(source, problems)
    return recipe


__all__ = [
    "BudgetConfig",
    "CheckpointConfig",
    "ConvertConfig",
    "DataConfig",
    "EvalConfig",
    "GuardConfig",
    "LogConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "Recipe",
    "RecipeError",
    "TrainConfig",
    "apply_overrides",
    "expand",
    "load_recipe",
    "recipe_from_dict",
    "shipped_recipes",
]
