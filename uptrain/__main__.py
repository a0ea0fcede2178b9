"""``python -m gqakit.uptrain`` / ``accelerate launch -m gqakit.uptrain RECIPE [overrides]``."""

import logging
import sys

from gqakit.uptrain.cli import uptrain_cmd

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    uptrain_cmd(prog_name="python -m gqakit.uptrain")
