"""What an uptraining run inside a pipeline is cached and resumed by: its recipe, less what does not change
the weights it trains.

``--no-progress`` sets ``log.progress``, and ``speed`` levers and the ``checkpoint`` cadence change how a
run goes, not what it trains; ``uptrain(resume=True)`` accepts all three (``RESUME_SAFE``). Keying or
resuming on the whole recipe would rerun an uptraining for a progress bar, or start a killed run over.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

NOT_WEIGHTS = ("log", "speed", "checkpoint")  # recipe sections that leave the trained weights as they are


def weights_key(recipe: dict[str, Any], ignore: Collection[str] = NOT_WEIGHTS) -> dict[str, Any]:
    """The recipe less the ``ignore`` sections.

    Args:
        recipe: ``Recipe.to_dict()``, or the ``recipe.yaml`` a run wrote, loaded.
        ignore: top-level sections left out.
    """
    return {k: v for k, v in recipe.items() if k not in ignore}


def same_run(out: Path, recipe, ignore: Collection[str] = NOT_WEIGHTS) -> bool:
    """Whether ``out`` holds a run of ``recipe`` (its ``recipe.yaml``) up to the ``ignore`` sections: a run
    killed under ``--progress`` resumes under ``--no-progress`` instead of starting over.

    Args:
        out: the run directory.
        recipe: the :class:`~gqakit.uptrain.recipe.Recipe` about to run.
        ignore: top-level sections that may differ.
    """
    saved = out / "recipe.yaml"
    if not saved.is_file():
        return False
    try:
        before = yaml.safe_load(saved.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        return False  # not a recipe gqakit wrote: start over
    now = yaml.safe_load(recipe.to_yaml())  # as written, so types compare as they were saved
    return isinstance(before, dict) and weights_key(before, ignore) == weights_key(now, ignore)


__all__ = ["NOT_WEIGHTS", "same_run", "weights_key"]
