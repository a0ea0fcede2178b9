"""Resuming never runs code from a run directory: a pickle planted in any file of a checkpoint is
refused with a message or never read, and never executed."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from gqakit.errors import GqakitError
from gqakit.uptrain import train
from gqakit.uptrain.recipe import RECIPES_DIR, load_recipe
from gqakit.uptrain.train import uptrain

# Every file a CPU checkpoint holds, and what a resume says when it is replaced by a pickle.
READ = {
    "model.safetensors": "model.safetensors is not a safetensors file of this model",
    "optimizer.pt": "optimizer.pt is not plain optimizer state \\(UnpicklingError",
    "rng_state_0.pt": "rng_state_0.pt is not plain RNG state \\(UnpicklingError",
    "trainer_state.json": "trainer_state.json cannot be read",
}
# What accelerate's save_state writes and load_state unpickles (gqakit before pickle-free checkpoints):
# gqakit never opens them.
NEVER_READ = [
    "custom_checkpoint_0.pkl",
    "custom_checkpoint_1.pkl",
    "random_states_0.pkl",
    "optimizer.bin",
    "scheduler.bin",
    "sampler.bin",
    "scaler.pt",
    "pytorch_model.bin",
]


class _Plant:
    """Unpickling this runs ``os.system`` (what an attacker's file would do): it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Killed(Exception):
    pass


def _recipe(assets, output_dir: Path):
    return load_recipe(
        RECIPES_DIR / "tiny.yaml",
        [
            f"model.path={assets['mha']}",
            f"data.files=[{assets['train']}]",
            f"output_dir={output_dir}",
            "budget.steps=4",
            "checkpoint.every=2",
        ],
    )


@pytest.fixture(scope="module")
def interrupted(assets, tmp_path_factory) -> Path:
    """A run killed at step 3, with its checkpoint at step 2 (made once, copied by each test)."""
    run = tmp_path_factory.mktemp("interrupted") / "run"
    log_train = train.log_train

    def die_at_step_3(run, *a, **k):
        log_train(run, *a, **k)
        if run.state.step == 3:
            raise _Killed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "log_train", die_at_step_3)
        with pytest.raises(_Killed):
            uptrain(_recipe(assets, run))
    return run


def _copy(interrupted: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the interrupted run (a run directory moved elsewhere resumes too) and its checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    return run, run / "checkpoints" / "step-00000002"


def test_a_checkpoint_holds_only_files_that_load_without_unpickling_code(interrupted):
    names = {p.name for p in (interrupted / "checkpoints" / "step-00000002").iterdir()}
    assert names == set(READ)  # a new file must join the table above, with its message


@pytest.mark.parametrize("target", [*READ, *NEVER_READ])
def test_a_planted_pickle_is_refused_or_ignored_never_executed(interrupted, assets, tmp_path, target):
    run, ckpt = _copy(interrupted, tmp_path)
    marker = tmp_path / "pwned"
    with open(ckpt / target, "wb") as fh:
        pickle.dump(_Plant(marker), fh)
    if target in READ:
        with pytest.raises(GqakitError, match=READ[target]) as e:
            uptrain(_recipe(assets, run), resume=True)
        assert "resume from an earlier one" in e.value.message or "without --resume" in e.value.message
    else:
        assert uptrain(_recipe(assets, run), resume=True).steps == 4
    assert not marker.exists()


def test_a_checkpoint_in_accelerates_pickle_format_is_refused_unread(interrupted, assets, tmp_path):
    run, ckpt = _copy(interrupted, tmp_path)
    for name in ("optimizer.pt", "rng_state_0.pt"):
        (ckpt / name).unlink()
    marker = tmp_path / "pwned"
    for name in ("optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"):
        with open(ckpt / name, "wb") as fh:
            pickle.dump(_Plant(marker), fh)
    with pytest.raises(GqakitError, match="lacks rng_state_0.pt, optimizer.pt: it is incomplete"):
        uptrain(_recipe(assets, run), resume=True)
    assert not marker.exists()


@pytest.mark.parametrize(
    "record",
    [[], {"step": 2}, {"step": "2", "batches_seen": 4, "lr_scale": 1.0, "rollbacks": 0, "skipped": 0,
                       "initial_val_ppl": None}, {"step": -1, "batches_seen": 4, "lr_scale": 1.0,
                       "rollbacks": 0, "skipped": 0, "initial_val_ppl": None}],
    ids=["a-list", "missing-counters", "a-string-step", "a-negative-step"],
)  # fmt: skip
def test_a_training_state_that_is_not_plain_counters_is_refused(tmp_path, record):
    from gqakit.uptrain.checkpoints import read_checkpoint_record

    (tmp_path / "trainer_state.json").write_text(json.dumps(record))
    with pytest.raises(GqakitError, match="is not a gqakit training state .* start over without --resume"):
        read_checkpoint_record(tmp_path)
