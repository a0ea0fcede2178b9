"""``uptrain(recipe)``: the one typed function behind ``gqakit uptrain`` and ``python -m gqakit.uptrain``.

It checks the inputs a recipe names (all problems at once), prepares the output directory, converts
the model first when the recipe has a ``convert:`` block, and runs :class:`~gqakit.uptrain.loop.UptrainLoop`.
Called in every process of an ``accelerate launch``; only the main process writes shared files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from gqakit.convert import convert_checkpoint
from gqakit.errors import GqakitError
from gqakit.locks import OWNER, exclusive
from gqakit.uptrain.loop import CHECKPOINTS, UptrainLoop, UptrainResult
from gqakit.uptrain.preflight import (
    PROVENANCE,
    RESUME_SAFE,
    check_inputs,
    output_problems,
    process_state,
    resume_problems,
)
from gqakit.uptrain.recipe import Recipe, expand

log = logging.getLogger("gqakit.uptrain")

CONVERTED = Path("work") / "converted"


def check_resumable(recipe: Recipe, out: Path) -> None:
    """Refuse ``--resume`` of the run in ``out`` with ``recipe`` where it would be another run
    (:func:`~gqakit.uptrain.preflight.resume_problems`), naming the differing keys."""
    problems = resume_problems(recipe, out, process_state().num_processes)
    if problems:
        raise GqakitError("\n".join(problems))


def prepare_output_dir(out: Path, resume: bool, force: bool, inputs: Sequence[str] = ()) -> None:
    """Refuse a non-empty run directory unless resuming or forcing; ``force`` empties it (main process).

    ``inputs`` (model, teacher, data paths) must not lie inside ``out``, which ``force`` would delete.
    """
    state = process_state()
    problems = output_problems(out, resume, force, inputs)
    if problems:
        raise GqakitError("\n".join(problems))
    busy = out.is_dir() and any(out.iterdir())
    state.wait_for_everyone()
    if state.is_main_process:
        if busy and force and not resume:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()


@contextmanager
def hold_run_dir(out: Path) -> Iterator[None]:
    """Hold the run directory ``out`` for one run: its main process locks ``.OUT.lock`` beside it (beside,
    so that ``--force`` and the emptiness check never see it). When another command holds it, every
    process of this one stops with the holder's pid and command: two runs in one directory would mix
    their checkpoints, and a ``--resume`` of either could read the other's."""
    state = process_state()
    busy = (
        f"output_dir {out} is in use by another run ({OWNER}). Two runs writing one directory would mix "
        "their checkpoints: wait for that run to finish, or choose another output_dir (override "
        "output_dir=DIR)."
    )
    made: list[Path] = []  # the parents this run creates, removed again if it fails
    try:
        with ExitStack() as held:
            refused: str | None = None
            if state.is_main_process:
                made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
                try:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    held.enter_context(exclusive(out.parent / f".{out.name}.lock", busy))
                except GqakitError as e:
                    refused = e.message
                except OSError:
                    pass  # a directory that cannot be written: check_inputs names it, with the fix
            if state.num_processes > 1:  # every rank learns the main process's answer
                # deferred: accelerate takes seconds to import
                from accelerate.utils import broadcast_object_list

                box = [refused]
                broadcast_object_list(box, from_process=0)
                refused = box[0]
            if refused is not None:
                raise GqakitError(refused)
            yield
    except BaseException:
        for p in made:  # innermost first; a directory something else was written into stays
            try:
                p.rmdir()
            except OSError:
                break
        raise


def _quiet_other_ranks(recipe: Recipe) -> None:
    """One log per run, not one per process: the other processes report errors only, and show no
    progress bars, unless ``log.all_ranks``."""
    if recipe.log.all_ranks or process_state().is_main_process:
        return
    # deferred: transformers takes seconds to import
    import datasets
    import transformers

    logging.getLogger("gqakit").setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def _convert_first(recipe: Recipe, out: Path) -> tuple[str, dict[str, Any]]:
    """Convert ``model.path`` into ``OUTPUT_DIR/work/converted`` (once; a resumed run reuses it)."""
    c = recipe.model.convert
    assert c is not None
    dst = out / CONVERTED
    state = process_state()
    if state.is_main_process and not (dst / PROVENANCE).is_file():
        log.info("converting %s to %d K/V head(s) (%s) into %s", recipe.model.path, c.groups, c.method, dst)
        options = c.options(expand, force=True)
        if recipe.speed.device != "auto":  # where the run trains, its conversion calibrates
            options = dataclasses.replace(options, device=recipe.speed.device)
        convert_checkpoint(recipe.model.path, dst, options)
    state.wait_for_everyone()
    return str(dst), {"convert": json.loads((dst / PROVENANCE).read_text())}


def uptrain(recipe: Recipe, *, resume: bool = False, force: bool = False) -> UptrainResult:
    """Run an uptraining recipe to the end and save the final model.

    Args:
        recipe: a validated recipe (:func:`gqakit.uptrain.recipe.load_recipe`).
        resume: continue the run in ``recipe.output_dir`` from its newest checkpoint (model, optimizer,
            schedule, RNG and data position); starts from the beginning when there is none yet.
        force: delete a non-empty ``recipe.output_dir`` first (ignored with ``resume``).

    Returns:
        An :class:`~gqakit.uptrain.loop.UptrainResult`; the model is a Hugging Face checkpoint at
        ``result.output_dir``.

    Raises:
        GqakitError: bad inputs (all listed at once), a non-empty output directory, too little data,
            or a run that stays non-finite after its rollbacks.
    """
    start = time.perf_counter()
    out = Path(expand(recipe.output_dir)).resolve()
    _quiet_other_ranks(recipe)
    with hold_run_dir(out):  # first: a run under way is the reason its directory is not empty
        check_inputs(recipe, resume=resume, force=force)  # everything, before any conversion or model load
        inputs = [recipe.model.path, *([recipe.teacher] if recipe.teacher else []), *recipe.data.files]
        fresh = not resume and (force or not (out.is_dir() and any(out.iterdir())))
        prepare_output_dir(out, resume, force, inputs + recipe.data.val_files)
        try:
            if process_state().is_main_process:
                (out / "recipe.yaml").write_text(recipe.to_yaml())
            model_path, extra = recipe.model.path, {}
            if recipe.model.convert is not None:
                model_path, extra = _convert_first(recipe, out)
            else:
                src = Path(expand(model_path)) / PROVENANCE
                if src.is_file():  # a checkpoint converted by gqakit: keep its conversion record
                    extra = {"convert": json.loads(src.read_text())}
            result = UptrainLoop(recipe, out, expand(model_path)).run(resume=resume, extra_provenance=extra)
        except BaseException:
            if fresh:
                _discard_failed_start(out)
            raise
    result.elapsed_s = time.perf_counter() - start
    return result


def _discard_failed_start(out: Path) -> None:
    """Delete the run directory of a run that failed before its first checkpoint, so that the same
    command can simply be run again (no --force). Kept when it holds something to resume from: a
    checkpoint, or a finished conversion (``--resume`` reuses it instead of converting again)."""
    if not process_state().is_main_process:
        return
    keep = (
        any((out / CHECKPOINTS).glob("step-*"))
        or (out / CONVERTED / PROVENANCE).is_file()
        or (out / PROVENANCE).is_file()  # a finished model (a failure after saving it)
    )
    if not keep:
        shutil.rmtree(out, ignore_errors=True)


__all__ = [
    "RESUME_SAFE",
    "check_inputs",
    "check_resumable",
    "hold_run_dir",
    "prepare_output_dir",
    "process_state",
    "uptrain",
]
