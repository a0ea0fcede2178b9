"""Resuming never runs code from a run directory: a pickle planted in a checkpoint is ignored or refused,
never executed."""

from __future__ import annotations

import os
import pickle

import pytest

from gqakit.errors import GqakitError
from gqakit.uptrain.api import uptrain
from gqakit.uptrain.loop import UptrainLoop


class _Plant:
    """Unpickling this runs ``os.system`` (what an attacker's file would do): it creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Killed(Exception):
    pass


def _interrupted_run(recipe, tmp_path, monkeypatch):
    """A run killed at step 3 with a checkpoint at step 2; return its recipe and the checkpoint."""
    r = recipe("budget.steps=4", "checkpoint.every=2", f"output_dir={tmp_path / 'run'}")
    log_train = UptrainLoop._log_train

    def die_at_step_3(self, *a, **k):
        log_train(self, *a, **k)
        if self.state.step == 3:
            raise _Killed

    monkeypatch.setattr(UptrainLoop, "_log_train", die_at_step_3)
    with pytest.raises(_Killed):
        uptrain(r)
    monkeypatch.setattr(UptrainLoop, "_log_train", log_train)
    (ckpt,) = (tmp_path / "run" / "checkpoints").iterdir()
    return r, ckpt


def test_checkpoints_hold_no_custom_pickles(recipe, tmp_path, monkeypatch):
    _, ckpt = _interrupted_run(recipe, tmp_path, monkeypatch)
    names = sorted(p.name for p in ckpt.iterdir())
    assert "trainer_state.json" in names
    assert not [n for n in names if n.startswith("custom_checkpoint")], names


@pytest.mark.parametrize(
    ("target", "message"),
    [
        # what accelerate unpickles with weights_only=False for registered objects (gqakit registers none)
        ("custom_checkpoint_0.pkl", "pickles that could run code when loaded"),
        ("custom_checkpoint_1.pkl", "pickles that could run code when loaded"),
        # read with weights_only=True; accelerate would skip a bad one and resume with other RNG state
        ("random_states_0.pkl", "random_states_0.pkl is not plain RNG state"),
        ("optimizer.bin", "could not be loaded safely .* without running code"),
    ],
)
def test_a_planted_pickle_is_refused_never_executed(recipe, tmp_path, monkeypatch, target, message):
    r, ckpt = _interrupted_run(recipe, tmp_path, monkeypatch)
    marker = tmp_path / "pwned"
    with open(ckpt / target, "wb") as fh:
        pickle.dump(_Plant(str(marker)), fh)
    with pytest.raises(GqakitError, match=message):
        uptrain(r, resume=True)
    assert not marker.exists()
    if target.startswith("custom_checkpoint"):  # as the message says: remove it and resume
        (ckpt / target).unlink()
        assert uptrain(r, resume=True).steps == 4
