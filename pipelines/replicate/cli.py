"""``gqakit replicate``: parse the options, run :func:`gqakit.pipelines.replicate.run.run_replicate`."""

from __future__ import annotations

from typing import Any

import click

from gqakit.cli_options import (
    cache_dir_option,
    device_option,
    fresh_option,
    list_option,
    out_option,
    progress_option,
    wheelhouse_option,
    work_dir_option,
)
from gqakit.pipelines.replicate.options import ARCHES, ARMS, ReplicateOptions
from gqakit.pipelines.replicate.run import pretrain_mha, run_replicate


@click.command("replicate")
@out_option("replicate-report", "Directory for report.md, results.json and the figures.")
@work_dir_option("replicate-work")
@click.option(
    "--scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Model width (x) and depth (x sqrt) and every token budget: 1 runs in under an hour on 2 CPU "
    "cores; 4 or more for a GPU.",
)
@click.option(
    "--arch",
    type=click.Choice(ARCHES.names),
    default="llama",
    show_default=True,
    help="Architecture of the MHA model pretrained here: " + ARCHES.describe() + ".",
)
@device_option()
@list_option("--seeds", kind=int, default="0,1", help="Seeds of the headline comparison.")
@list_option(
    "--alphas",
    kind=float,
    default="0,0.025,0.05,0.1",
    help="Uptraining proportions of the pretraining tokens.",
)
@list_option("--groups", kind=int, default="1,2,4", help="K/V head counts of the G sweep.")
@list_option(
    "--methods", default=",".join(ARMS), help="Conversion methods of the MQA arms: " + ARMS.describe() + "."
)
@click.option(
    "--uptrain-lr",
    type=float,
    default=ReplicateOptions.uptrain_lr,
    show_default=True,
    help="Peak learning rate of the uptraining runs (and the MHA model's continued training).",
)
@fresh_option()
@click.option(
    "--pretrain-only",
    is_flag=True,
    help="Only train the tokenizer and the MHA model (recipes/replicate-mha.yaml) and make it the asset "
    "replicate-mha.",
)
@progress_option()
@cache_dir_option()
@wheelhouse_option()
def replicate_cmd(pretrain_only: bool, **settings: Any) -> None:
    """Re-run the GQA paper's experiments (Ainslie et al. 2023) on an MHA model pretrained here: which
    start (Fig. 4), how much uptraining (Fig. 5), how many groups (Fig. 6, Table 1), uptrained against
    trained from scratch; with gqakit's calibrated merge and refinement beside the paper's methods."""
    # every other parameter is named after its ReplicateOptions field, so the options name each flag
    options = ReplicateOptions(**settings)
    if pretrain_only:
        click.echo(f"MHA model: {pretrain_mha(options)}")
        return
    run_replicate(options)


__all__ = ["replicate_cmd"]
