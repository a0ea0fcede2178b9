"""Ending an uptraining run right after a given step is logged, as a kill would, for the resume tests.

In the test's process, :func:`kill_after` runs a recipe and stops it with :class:`Killed` (the test goes
on with the run's files). As a script, ``python die_after_step.py STEP RECIPE [overrides] [--resume]``
runs ``gqakit.uptrain`` and kills the whole process with SIGKILL right after step STEP is logged (no
cleanup, no final model); it runs under ``accelerate launch`` like
``-m gqakit.uptrain``, for the tests of resuming after a real kill of a distributed run.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from gqakit.uptrain import train
from gqakit.uptrain.setup import Run


class Killed(Exception):
    """The in-process stand-in for a kill."""


def die_after_step(
    step: int, die: Callable[[], Any], patch: Callable[[Any, str, Any], None] = setattr
) -> None:
    """Make every uptraining run call ``die()`` right after it logs step ``step``. ``patch`` sets the
    function (``monkeypatch.setattr`` in a test, so it is undone afterwards)."""
    log_train = train.log_train

    def logged_then_die(run: Run, *args: Any, **kwargs: Any) -> None:
        log_train(run, *args, **kwargs)
        if run.state.step == step:
            die()

    patch(train, "log_train", logged_then_die)


def _raise_killed() -> None:
    raise Killed


def kill_after(step: int, run: Callable[[], Any], monkeypatch: Any) -> None:
    """Call ``run()`` (an uptraining run) and stop it with :class:`Killed` right after step ``step`` is
    logged; the function is restored afterwards."""
    import pytest

    with monkeypatch.context() as patched:
        die_after_step(step, _raise_killed, patched.setattr)
        with pytest.raises(Killed):
            run()


def _exit_now() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from gqakit.uptrain.cli import uptrain_cmd

    die_after_step(int(sys.argv.pop(1)), _exit_now)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    uptrain_cmd(prog_name="die_after_step.py")
