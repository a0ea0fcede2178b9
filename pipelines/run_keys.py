"""An uptraining run inside a pipeline: what it is cached and resumed by (its recipe, less what does not
change the weights it trains), and :func:`train_once`, the run itself, cached and resumed.

``--no-progress`` sets ``log.progress``, and ``speed`` levers and the ``checkpoint`` cadence change how a
run goes, not what it trains; ``uptrain(resume=True)`` accepts all three (``RESUME_SAFE``). Keying or
resuming on the whole recipe would rerun an uptraining for a progress bar, or start a killed run over.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import yaml

from gqakit.pipelines.store import ResultStore
from gqakit.uptrain import uptrain

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
        recipe: the :class:`~gqakit.uptrain.recipe_schema.Recipe` about to run.
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


def _started_after(started: Path, inputs: Sequence[Path]) -> bool:
    """True when the file ``started`` was written after every file of ``inputs`` (files or directories)."""
    files = [f for p in inputs for f in ([p] if p.is_file() else p.iterdir()) if f.is_file()]
    return all(f.stat().st_mtime_ns <= started.stat().st_mtime_ns for f in files)


def train_once(
    store: ResultStore,
    name: str,
    recipe,
    key: dict[str, Any],
    *,
    fresh: bool,
    resume_over: Collection[str] = NOT_WEIGHTS,
    inputs: Sequence[Path] = (),
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Run ``recipe`` into its ``output_dir`` unless the same run finished there (cached in ``store`` as
    ``name`` under ``key``, and only while the directory is unchanged); a run killed before it finished
    resumes from its last checkpoint when its recipe is the same up to ``resume_over`` and it started after
    every one of ``inputs`` was written (a rebuilt start or text under the same path starts over).

    Returns:
        The run's summary (``extra`` included; ``elapsed_s`` its recorded compute time) and whether it was
        reused.
    """
    out = Path(recipe.output_dir)
    cached = store.get_output(name, key, out)
    reused = cached is not None
    if not reused:
        resume = (
            same_run(out, recipe, resume_over)
            and not (out / "gqakit.json").is_file()
            and not fresh
            and _started_after(out / "recipe.yaml", inputs)
        )
        res = uptrain(recipe, resume=resume, force=not resume)
        summary = {
            "steps": int(res.steps),
            "tokens": int(res.tokens),
            "alpha": res.alpha,
            "initial_val_ppl": res.initial_val_ppl,
            "final_val_ppl": res.final_val_ppl,
            "metrics": str(res.history),
            **(extra or {}),
        }
        cached = store.put_output(name, key, out, summary)
    return {**cached, "elapsed_s": round(store.time_of(name) or 0.0, 1)}, reused
