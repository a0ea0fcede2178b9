"""``python die_after_step.py STEP RECIPE [overrides] [--resume]``: run ``gqakit.uptrain`` and end the
process with ``os._exit(137)`` right after step STEP is logged, as a SIGKILL would (no cleanup, no final
model). Runs under ``accelerate launch`` like ``-m gqakit.uptrain``, for tests of resuming after a real
kill of a distributed run."""

from __future__ import annotations

import logging
import os
import sys

from gqakit.uptrain.cli import uptrain_cmd
from gqakit.uptrain.loop import UptrainLoop

if __name__ == "__main__":
    step = int(sys.argv.pop(1))
    log_train = UptrainLoop._log_train

    def die(self, *args, **kwargs):
        log_train(self, *args, **kwargs)
        if self.state.step == step:
            sys.stderr.flush()
            os._exit(137)

    UptrainLoop._log_train = die  # type: ignore[method-assign]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    uptrain_cmd(prog_name="die_after_step.py")
