"""``uptrain(recipe)``: the one typed function behind ``gqakit uptrain`` and ``python -m gqakit.uptrain``.

It checks the inputs a recipe names (all problems at once), prepares the output directory, converts
the model first when the recipe has a ``convert:`` block, and runs :class:`~gqakit.uptrain.loop.UptrainLoop`.
Called in every process of an ``accelerate launch``; only the main process writes shared files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gqakit.errors import GqakitError
from gqakit.models import check_causal_lm, max_positions
from gqakit.outputs import writable_dir
from gqakit.uptrain.data import resolve_files
from gqakit.uptrain.loop import CHECKPOINTS, PROVENANCE, UptrainLoop, UptrainResult
from gqakit.uptrain.recipe import Recipe, expand

log = logging.getLogger("gqakit.uptrain")

CONVERTED = Path("work") / "converted"


def _hub_like(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _config(path: str, key: str, problems: list[str]) -> dict[str, Any] | None:
    """``config.json`` of a local checkpoint (None for a hub id); record a problem when it is unusable."""
    p = Path(expand(path))
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            problems.append(f"{key}: {p} has no config.json; point at a Hugging Face model directory.")
            return None
        try:
            return json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            problems.append(f"{key}: {cfg} is not valid JSON ({e}).")
            return None
    if p.exists():
        problems.append(f"{key}: {p} is a file; give a checkpoint directory.")
    elif not _hub_like(path):
        problems.append(f"{key}: {path} does not exist.")
    return None


def check_inputs(recipe: Recipe) -> None:
    """Check the model, teacher and data files a recipe names, before any work; report all problems."""
    problems: list[str] = []
    model_cfg = _config(recipe.model.path, "model.path", problems)
    teacher_cfg = (
        _config(recipe.teacher, "teacher", problems)
        if recipe.teacher and recipe.objective.kind != "lm"
        else None
    )
    for cfg, key, path in (
        (model_cfg, "model.path", recipe.model.path),
        (teacher_cfg, "teacher", recipe.teacher),
    ):
        if cfg is not None:
            try:
                check_causal_lm(cfg, path, what="model" if key == "model.path" else "teacher")
            except GqakitError as e:
                problems.append(f"{key}: {e.message}")
    limit = max_positions(SimpleNamespace(**model_cfg)) if model_cfg else None
    if limit is not None and recipe.data.seq_len > limit:
        problems.append(
            f"data.seq_len {recipe.data.seq_len} is more than the {limit} positions of {recipe.model.path} "
            f"(max_position_embeddings); set data.seq_len={limit} or less."
        )
    if model_cfg and teacher_cfg and model_cfg.get("vocab_size") != teacher_cfg.get("vocab_size"):
        problems.append(
            f"teacher {recipe.teacher} has a vocabulary of {teacher_cfg.get('vocab_size')} tokens and the "
            f"model {recipe.model.path} one of {model_cfg.get('vocab_size')}: distillation compares their "
            "logits token by token, so the teacher must share the model's tokenizer (use the checkpoint the "
            "model was converted from)."
        )
    if model_cfg and recipe.model.convert is not None:
        from gqakit.convert.api import check_groups
        from gqakit.geometry import AttentionGeometry

        try:
            check_groups(AttentionGeometry.from_config(model_cfg), recipe.model.convert.groups)
        except GqakitError as e:
            problems.append(f"model.convert.groups: {e.message}")
    if not recipe.data.hub:
        resolve_files(recipe.data.files, "data.files", problems)
        resolve_files(recipe.data.val_files, "data.val_files", problems)
    if problems:
        lines = ["The recipe's inputs have problems:", *(f"  - {p}" for p in problems)]
        cache = os.environ.get("GQAKIT_CACHE")
        if any(".cache/gqakit" in p or (cache and cache in p) for p in problems):
            lines.append(
                "The shipped recipes read the demo assets: run `gqakit assets fetch` first, or override "
                "the paths (model.path=DIR teacher=DIR data.files=[...] data.val_files=[...])."
            )
        raise GqakitError("\n".join(lines))


# What a resumed run may change: how long it trains, how often it evaluates, logs and checkpoints.
# Anything else (data, batch, lr, schedule shape, objective, model, seed...) would make the resumed run
# a different run than the checkpoint's, with wrong token counts.
RESUME_SAFE: tuple[str, ...] = (
    "budget.steps",
    "budget.tokens",
    "budget.alpha",
    "eval.",
    "log.",
    "checkpoint.",
)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_resumable(recipe: Recipe, out: Path) -> None:
    """Refuse ``--resume`` with a recipe that differs from the run's own (``OUTPUT_DIR/recipe.yaml``) in
    anything outside :data:`RESUME_SAFE`, naming the keys."""
    import yaml

    saved_file = out / "recipe.yaml"
    if not saved_file.is_file():
        return
    saved = _flat(yaml.safe_load(saved_file.read_text()) or {})
    now = _flat(recipe.to_dict())
    changed = sorted(
        k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k) and not k.startswith(RESUME_SAFE)
    )
    if changed:
        diffs = ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in changed)
        raise GqakitError(
            f"--resume continues the run in {out}, but the recipe differs from the one it started with in "
            f"{diffs}: the resumed run would not be the run its checkpoints belong to. Resume with the same "
            "recipe (only budget.steps/tokens/alpha, eval.*, log.* and checkpoint.* may change), or start "
            "over with --force or another output_dir."
        )


def process_state():
    """accelerate's per-process state (rank, world size, barriers), as ``Accelerator`` will see it.

    ``PartialState()`` alone ignores ``ACCELERATE_USE_CPU`` (only ``AcceleratorState`` reads it), and the
    first call fixes the state for the whole process: a 2-process CPU launch would then run as two
    independent single processes.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))


def prepare_output_dir(out: Path, resume: bool, force: bool, inputs: Sequence[str] = ()) -> None:
    """Refuse a non-empty run directory unless resuming or forcing; ``force`` empties it (main process).

    ``inputs`` (model, teacher, data paths) must not lie inside ``out``, which ``force`` would delete.
    """
    state = process_state()
    if out.exists() and not out.is_dir():
        raise GqakitError(f"output_dir {out} is a file: choose a directory path.")
    for item in inputs:
        path = Path(expand(item)).resolve()
        if path == out or out in path.parents:
            raise GqakitError(f"{item} is inside output_dir {out}: choose an output_dir outside the inputs.")
    busy = out.is_dir() and any(out.iterdir())
    if busy and resume and (out / PROVENANCE).is_file():
        raise GqakitError(
            f"{out} holds a finished run ({PROVENANCE} is there): nothing to resume. Pass --force to train "
            "again from scratch, or choose another output_dir."
        )
    if busy and not (resume or force):
        raise GqakitError(
            f"output_dir {out} exists and is not empty. Pass --resume to continue the run in it, --force to "
            "delete it and start over, or choose another output_dir (override output_dir=DIR)."
        )
    writable_dir(out, "output_dir")  # a read-only parent: one message, before any model loads
    state.wait_for_everyone()
    if state.is_main_process:
        if busy and force and not resume:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()


def _convert_first(recipe: Recipe, out: Path) -> tuple[str, dict[str, Any]]:
    """Convert ``model.path`` into ``OUTPUT_DIR/work/converted`` (once; a resumed run reuses it)."""
    from gqakit.convert import ConvertOptions, convert_checkpoint

    c = recipe.model.convert
    assert c is not None
    dst = out / CONVERTED
    state = process_state()
    if state.is_main_process and not (dst / PROVENANCE).is_file():
        log.info("converting %s to %d K/V head(s) (%s) into %s", recipe.model.path, c.groups, c.method, dst)
        convert_checkpoint(
            recipe.model.path,
            dst,
            ConvertOptions(
                c.groups,
                c.method,
                seed=c.seed,
                force=True,
                calib_data=expand(c.calib_data) if c.calib_data else None,
                calib_tokens=c.calib_tokens,
                grouping=c.grouping,
                refine_steps=c.refine_steps,
                refine_lr=c.refine_lr,
            ),
        )
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
    if not recipe.log.all_ranks and not process_state().is_main_process:
        logging.getLogger("gqakit").setLevel(logging.WARNING)  # one log, not one per rank
    check_inputs(recipe)
    if resume:
        check_resumable(recipe, out)
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


__all__ = ["RESUME_SAFE", "check_inputs", "check_resumable", "prepare_output_dir", "uptrain"]
