"""Checkpoints of an uptraining run, and resuming from them without unpickling anything.

A checkpoint is ``OUTPUT_DIR/checkpoints/step-NNNNNNNN/``: the model, optimizer, gradient scaler and RNG
states (:mod:`gqakit.uptrain.state_io`: safetensors, ``torch.load(weights_only=True)`` and JSON, never
accelerate's pickles) and gqakit's own training state as JSON (``trainer_state.json``: step, data
position, learning-rate scale, counters, processes). It is written into a hidden directory and renamed
into place, so a kill leaves either a whole checkpoint or none. The learning-rate schedule is a pure
function of the step, so it needs no saved state.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError
from gqakit.files import write_json
from gqakit.uptrain.state_io import load_training_state, save_training_state

log = logging.getLogger("gqakit.uptrain")

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"


class TrainState:
    """Counters saved in every checkpoint, as JSON (``trainer_state.json``).

    ``batches_seen`` is the data position: micro-batches this process has drawn, across epochs. It is
    not rolled back with the weights, so a rollback goes on with fresh data.
    """

    def __init__(self) -> None:
        self.step = 0
        self.batches_seen = 0
        self.lr_scale = 1.0
        self.rollbacks = 0
        self.skipped = 0
        self.initial_val_ppl: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint directory (``checkpoints/step-00000100``), or None."""
    found = sorted((Path(output_dir) / CHECKPOINTS).glob("step-*"))
    return found[-1] if found else None


def _counter_ok(value: Any, default: Any) -> bool:
    """A non-negative number of the counter's kind (an int where the default is one), or None."""
    if value is None:
        return default is None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return False
    return isinstance(value, int) or not isinstance(default, int)


def read_checkpoint_record(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of the checkpoint ``path``, checked: the counters are plain numbers."""
    file = path / STATE_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GqakitError(
            f"{file} cannot be read ({type(e).__name__}): the checkpoint is incomplete or damaged. Remove "
            f"{path} to resume from the one before it, or start over without --resume."
        ) from None
    want = vars(TrainState())
    numbers = isinstance(data, dict) and all(k in data and _counter_ok(data[k], d) for k, d in want.items())
    if not numbers:
        raise GqakitError(
            f"{file} is not a gqakit training state (non-negative numbers under {', '.join(want)}). Remove "
            f"{path} to resume from the one before it, or start over without --resume."
        )
    return data


def read_train_state(path: Path) -> dict[str, Any]:
    """The :class:`TrainState` counters of the checkpoint ``path``."""
    data = read_checkpoint_record(path)
    return {k: data[k] for k in vars(TrainState())}


class CheckpointMixin:
    """Saving, resuming and rolling back the loop's state (model, optimizer, RNG, counters)."""

    def _save_checkpoint(self) -> None:
        acc, step = self.acc, self.state.step
        root = self.out / CHECKPOINTS
        final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.partial"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        save_training_state(acc, self.model, self.optimizer, tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            extra = {"tokens": self.budget.tokens(step), "processes": acc.num_processes}
            write_json(tmp / STATE_FILE, {**self.state.state_dict(), **extra})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in sorted(root.glob("step-*"))[: -self.recipe.checkpoint.keep or None]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def _load_checkpoint(self, path: Path, counters: bool = True) -> None:
        """Restore the model, optimizer, scaler and RNG (:mod:`~gqakit.uptrain.state_io`) and the
        training state (JSON); with ``counters=False`` only the step comes back (a rollback keeps its
        counters)."""
        state = read_train_state(path)
        load_training_state(self.acc, self.model, self.optimizer, path)
        if counters:
            self.state.load_state_dict(state)
        else:
            self.state.step = state["step"]
        # accelerate counts micro-steps to know when gradients sync; a step is grad_accum of them.
        self.acc.step = self.state.step * self.recipe.train.grad_accum
        self.scheduler.last_epoch = self.state.step  # the schedule is a function of the step
        self._apply_lr()

    def _apply_lr(self) -> None:
        """Put the current step's learning rate into the optimizer (the schedule's lambda reads lr_scale)."""
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * self._lr_lambda(self.scheduler.last_epoch)

    def resume(self) -> bool:
        """Restore the newest checkpoint (model, optimizer, schedule, RNG, data position); False if none."""
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            log.info("no checkpoint in %s yet: starting from the beginning", self.out / CHECKPOINTS)
            self.metrics.truncate_after(-1)  # a run killed before its first checkpoint logged steps
            return False
        self._load_checkpoint(ckpt)
        self.metrics.truncate_after(self.state.step)
        log.info("resumed from %s: %s", ckpt, self.budget.progress(self.state.step))
        return True

    def _rollback(self) -> None:
        g, s = self.recipe.guard, self.state
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            raise GqakitError(
                f"{g.max_bad_steps} non-finite steps in a row at step {s.step} and no checkpoint to roll "
                f"back to. Lower train.lr (now {self.recipe.train.lr:g}), or set checkpoint.every so the "
                "guard can roll back."
            )
        if s.rollbacks >= g.max_rollbacks:
            raise GqakitError(
                f"Still non-finite after {s.rollbacks} rollback(s) (learning rate x{s.lr_scale:g}) at step "
                f"{s.step}. Lower train.lr, raise train.warmup_fraction, or use train.precision=fp32/bf16."
            )
        # Weights, optimizer, schedule and RNG come back from the checkpoint; the data position and the
        # counters go on, and the learning rate drops.
        self._load_checkpoint(ckpt, counters=False)
        s.lr_scale, s.rollbacks = s.lr_scale * g.lr_factor, s.rollbacks + 1
        self._apply_lr()
        log.warning("rolled back to %s; learning rate now x%g", ckpt.name, s.lr_scale)
        # The steps past the checkpoint are run again, as after a resume: their records go, so the
        # history holds each step once (the rollback record below says what happened).
        self.metrics.truncate_after(s.step)
        self.metrics.write(
            {"step": s.step, "event": "rollback", "checkpoint": ckpt.name, "lr_scale": s.lr_scale}
        )
