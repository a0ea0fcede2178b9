"""Checkpoints of an uptraining run, and resuming from them without unpickling anything.

A checkpoint is ``OUTPUT_DIR/checkpoints/step-NNNNNNNN/``: accelerate's ``save_state`` of the model
(safetensors), optimizer, gradient scaler, samplers and RNG states, and gqakit's own training state as
JSON (``trainer_state.json``: step, data position, learning-rate scale, counters). Run directories are
shared and downloaded, so nothing in one may run code on resume: gqakit registers no custom objects
with accelerate (whose custom-state files are unpickled with ``weights_only=False``), and everything
accelerate reads back it reads with ``torch.load(weights_only=True)``, which refuses pickled code. The
learning-rate schedule is a pure function of the step, so it needs no saved state.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from gqakit.checkpoint import write_json
from gqakit.errors import GqakitError

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


def read_train_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of the checkpoint ``path``, checked: plain numbers, nothing else."""
    try:
        data = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GqakitError(
            f"{path / STATE_FILE} cannot be read ({e}): the checkpoint is incomplete or damaged. Remove "
            f"{path} to resume from the one before it, or start over without --resume."
        ) from None
    want = set(vars(TrainState()))
    if not isinstance(data, dict) or not want <= set(data):
        raise GqakitError(f"{path / STATE_FILE} is not a gqakit training state (keys {sorted(want)}).")
    return {k: data[k] for k in want}


def _check_pickles(path: Path, process_index: int) -> None:
    """Refuse what accelerate would unpickle unsafely or skip silently: custom-state pickles (read with
    ``weights_only=False``; gqakit writes none), and an RNG file that a ``weights_only`` load refuses
    (accelerate would go on without it, and the resumed run would differ from an uninterrupted one)."""
    from accelerate.utils import load

    custom = sorted(p.name for p in path.glob("custom_checkpoint_*.pkl"))
    if custom:
        raise GqakitError(
            f"The checkpoint {path} holds {', '.join(custom)}: pickles that could run code when loaded, "
            "which gqakit never reads (an older gqakit wrote them, or someone planted them). Its training "
            f"state is in {STATE_FILE}: remove those files and resume again."
        )
    rng = path / f"random_states_{process_index}.pkl"
    if rng.is_file():
        try:
            load(rng)  # weights_only=True, with numpy's array types allowed
        except Exception as e:
            raise GqakitError(
                f"The checkpoint {path} could not be loaded safely: {rng.name} is not plain RNG state "
                f"({type(e).__name__}). gqakit loads checkpoints without running code from them; remove "
                "the checkpoint to resume from an earlier one, or start over without --resume."
            ) from None


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
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            write_json(tmp / STATE_FILE, {**self.state.state_dict(), "tokens": self.budget.tokens(step)})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in sorted(root.glob("step-*"))[: -self.recipe.checkpoint.keep or None]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def _load_checkpoint(self, path: Path, counters: bool = True) -> None:
        """Restore the model, optimizer and RNG (accelerate, ``weights_only`` loads) and the training state
        (JSON); with ``counters=False`` only the step comes back (a rollback keeps its counters)."""
        state = read_train_state(path)
        _check_pickles(path, self.acc.process_index)
        try:
            self.acc.load_state(str(path))
        except Exception as e:  # torch refuses a pickle with code in it: UnpicklingError and friends
            raise GqakitError(
                f"The checkpoint {path} could not be loaded safely ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). gqakit loads checkpoints without running "
                "code from them; this one holds something gqakit did not write. Remove it to resume from "
                "an earlier one, or start over without --resume."
            ) from None
        if counters:
            self.state.load_state_dict(state)
        else:
            self.state.step = state["step"]
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
        self.metrics.write(
            {"step": s.step, "event": "rollback", "checkpoint": ckpt.name, "lr_scale": s.lr_scale}
        )
