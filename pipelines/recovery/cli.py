"""``gqakit recovery``: the options of :class:`RecoveryOptions` as flags, then
:func:`gqakit.pipelines.recovery.run.run_recovery`."""

from __future__ import annotations

from typing import Any

import click

from gqakit.cli_options import click_options, options_from
from gqakit.pipelines.recovery.options import RecoveryOptions
from gqakit.pipelines.recovery.run import run_recovery
from gqakit.pipelines.steps import set_option


@click.command("recovery")
@click.argument("src")
@click_options(RecoveryOptions, skip=("src",))
@click.option(
    "--start-lr",
    "start_lr",
    multiple=True,
    metavar="START=LR[,LR...]",
    help="A start's own peak learning rates (repeatable), e.g. --start-lr mean=5e-4; several rates make "
    "one run each and the savings take each start's best per threshold.",
)
@set_option(
    "Override the runs' recipe (repeatable), e.g. --set data.seq_len=128, --set objective.kind=lm; "
    "model.convert.calib_tokens=... and model.convert.refine_* change the starts that use them."
)
def recovery_cmd(**kwargs: Any) -> None:
    """Convert SRC (a checkpoint directory, a hub id or an asset name such as smollm2-135m) to --groups
    K/V heads from each start, uptrain each on the same data, and report how many tokens each needs to
    reach 2x, 1.5x, 1.2x, 1.1x and 1.05x the original's held-out perplexity, and what each start saves
    over the first. Cached and resumable in --work-dir: a rerun takes seconds."""
    run_recovery(options_from(RecoveryOptions, kwargs))


__all__ = ["recovery_cmd"]
