"""The run directory and what a run writes in it: the lock and the directory (:func:`hold_run_dir`,
:func:`run_dir`), the records (``metrics.jsonl``, TensorBoard, the log; :func:`read_history`), and the
checkpoints with resume and rollback. The run itself reads top to bottom in :mod:`gqakit.uptrain.train`."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gqakit.errors import GqakitError
from gqakit.locks import OWNER, exclusive
from gqakit.storage import write_text
from gqakit.uptrain.preflight import process_state
from gqakit.uptrain.setup import Run
from gqakit.uptrain.state_io import (
    CHECKPOINTS,
    PROVENANCE,
    TrainState,
    latest_checkpoint,
    load_training_state,
    save_training_state,
)

log = logging.getLogger("gqakit.uptrain")

CONVERTED = Path("work") / "converted"
METRICS = "metrics.jsonl"


# ------------------------------------------------------------------------------------------ The run directory


@contextlib.contextmanager
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
        with contextlib.ExitStack() as held:
            refused: str | None = None
            if state.is_main_process:
                made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
                try:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    held.enter_context(exclusive(out.parent / f".{out.name}.lock", busy))
                except GqakitError as e:
                    refused = e.message
                except OSError:
                    pass  # a directory that cannot be written: preflight names it, with the fix
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


@contextlib.contextmanager
def run_dir(out: Path, resume: bool, force: bool) -> Iterator[None]:
    """Create the run directory (``force``: empty it first), in the main process, once every process has
    checked it (:func:`~gqakit.uptrain.preflight.preflight`).

    A new run that fails before its first checkpoint deletes it again, so that the same command can simply
    be run again (no --force). It is kept when it holds something to resume from: a checkpoint, or a
    finished conversion (``--resume`` reuses it instead of converting again).
    """
    state = process_state()
    busy = out.is_dir() and any(out.iterdir())
    state.wait_for_everyone()
    if state.is_main_process:
        if busy and force and not resume:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    try:
        yield
    except BaseException:
        keep = (
            resume
            or (busy and not force)
            or any((out / CHECKPOINTS).glob("step-*"))
            or (out / CONVERTED / PROVENANCE).is_file()
            or (out / PROVENANCE).is_file()  # a finished model (a failure after saving it)
        )
        if state.is_main_process and not keep:
            shutil.rmtree(out, ignore_errors=True)
        raise


# ------------------------------- Records: metrics.jsonl (main process), TensorBoard when installed, the log


def log_train(
    run: Run, stats: torch.Tensor, grad_norm: Any, lr: float, tok_s: float, steps_here: int, elapsed: float
) -> None:
    s, b, kind = run.state, run.budget, run.recipe.objective.kind
    record: dict[str, Any] = {"step": s.step, "tokens": b.tokens(s.step), "alpha": b.alpha(s.step)}
    record["loss"] = stats[0].item()
    if kind in ("lm", "mix"):
        record["lm"] = stats[1].item()
    if kind in ("distill", "mix"):
        record["kl"] = stats[2].item()
    record.update(
        lr=lr,
        grad_norm=float(grad_norm),
        tokens_per_s=tok_s,
        avg_tokens_per_s=steps_here * b.tokens_per_step / max(elapsed, 1e-9),
    )
    write_record(run, record)
    run.acc.log({f"train/{k}": v for k, v in record.items() if isinstance(v, float | int)}, step=s.step)


def log_eval(run: Run, loss: float, ppl: float) -> None:
    s, b = run.state, run.budget
    record = {"step": s.step, "tokens": b.tokens(s.step), "alpha": b.alpha(s.step)}
    write_record(run, {**record, "val_loss": loss, "val_ppl": ppl})
    run.acc.log({"val/loss": loss, "val/ppl": ppl}, step=s.step)
    log.info("%s: validation loss %.4f, perplexity %.3f", b.progress(s.step), loss, ppl)


def write_record(run: Run, record: dict[str, Any]) -> None:
    """Append one JSON line to ``metrics.jsonl`` (main process)."""
    if run.acc.is_main_process:
        with open(run.out / METRICS, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def truncate_records(run: Run, step: int) -> None:
    """Drop the records past ``step`` (a resumed run writes them again), and a line a kill cut short."""
    path = run.out / METRICS
    if run.acc.is_main_process and path.is_file():

        def record_step(line: str) -> float:  # infinity for a line that is not a whole record
            try:
                value = json.loads(line).get("step", 0)
            except (json.JSONDecodeError, AttributeError):
                return math.inf
            return value if isinstance(value, int | float) else math.inf

        keep = [ln for ln in path.read_text().splitlines() if record_step(ln) <= step]
        write_text(path, "".join(ln + "\n" for ln in keep))  # atomically: a kill keeps the records whole


def read_history(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``: training steps (``loss``...), evaluations (``val_ppl``)."""
    path = Path(output_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------- Checkpoints, resume and rollback


def save_checkpoint(run: Run) -> None:
    """``checkpoints/step-NNNNNNNN``, written into a hidden directory and renamed into place (a kill
    leaves a whole checkpoint or none); only the newest ``checkpoint.keep`` stay."""
    acc, step = run.acc, run.state.step
    root = run.out / CHECKPOINTS
    final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.partial"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    extra = {"tokens": run.budget.tokens(step), "processes": acc.num_processes}
    save_training_state(acc, run.model, run.optimizer, tmp, {**asdict(run.state), **extra})
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(root.glob("step-*"))[: -run.recipe.checkpoint.keep or None]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()


def load_checkpoint(run: Run, path: Path, counters: bool = True) -> None:
    """Restore the model, optimizer, scaler and RNG and the counters; with ``counters=False`` only the
    step comes back (a rollback keeps its counters)."""
    record = load_training_state(run.acc, run.model, run.optimizer, path)
    if counters:
        run.state = TrainState(**{k: record[k] for k in asdict(run.state)})
    else:
        run.state.step = record["step"]
    # accelerate counts micro-steps to know when gradients sync; a step is grad_accum of them.
    run.acc.step = run.state.step * run.recipe.train.grad_accum


def resume_run(run: Run) -> None:
    """Restore the newest checkpoint (model, optimizer, schedule, RNG, data position), if there is one."""
    ckpt = latest_checkpoint(run.out)
    if ckpt is None:
        log.info("no checkpoint in %s yet: starting from the beginning", run.out / CHECKPOINTS)
        truncate_records(run, -1)  # a run killed before its first checkpoint logged steps
        return
    load_checkpoint(run, ckpt)
    truncate_records(run, run.state.step)
    log.info("resumed from %s: %s", ckpt, run.budget.progress(run.state.step))


def rollback(run: Run) -> None:
    """Back to the last checkpoint after ``guard.max_bad_steps`` non-finite steps in a row: weights,
    optimizer, schedule and RNG come back; the data position and the counters go on, and the learning
    rate drops by ``guard.lr_factor``."""
    g, s = run.recipe.guard, run.state
    ckpt = latest_checkpoint(run.out)
    if ckpt is None:
        raise GqakitError(
            f"{g.max_bad_steps} non-finite steps in a row at step {s.step} and no checkpoint to roll back "
            f"to. Lower train.lr (now {run.recipe.train.lr:g}), or set checkpoint.every so the guard can "
            "roll back."
        )
    if s.rollbacks >= g.max_rollbacks:
        raise GqakitError(
            f"Still non-finite after {s.rollbacks} rollback(s) (learning rate x{s.lr_scale:g}) at step "
            f"{s.step}. Lower train.lr, raise train.warmup_fraction, or use train.precision=fp32/bf16."
        )
    load_checkpoint(run, ckpt, counters=False)
    s.lr_scale, s.rollbacks = s.lr_scale * g.lr_factor, s.rollbacks + 1
    log.warning("rolled back to %s; learning rate now x%g", ckpt.name, s.lr_scale)
    # The steps past the checkpoint are run again, as after a resume: their records go, so the history
    # holds each step once (the rollback record says what happened).
    truncate_records(run, s.step)
    write_record(run, {"step": s.step, "event": "rollback", "checkpoint": ckpt.name, "lr_scale": s.lr_scale})
