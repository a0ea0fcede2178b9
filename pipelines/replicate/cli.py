"""``gqakit replicate``: the options of :class:`ReplicateOptions` as flags, then
:func:`gqakit.pipelines.replicate.run.run_replicate`."""

from __future__ import annotations

from typing import Any

import click

from gqakit.cli_options import click_options, options_from
from gqakit.pipelines.replicate.options import ReplicateOptions
from gqakit.pipelines.replicate.run import pretrain_mha, run_replicate
from gqakit.pipelines.steps import set_option


@click.command("replicate")
@click_options(ReplicateOptions)
@set_option(
    "Override the uptraining runs' recipe (repeatable), e.g. --set train.lr=1e-3; model.convert.* "
    "changes the conversions that use it."
)
@click.option(
    "--pretrain-only",
    is_flag=True,
    help="Only train the tokenizer and the MHA model (recipes/replicate-mha.yaml) and make it the asset "
    "replicate-mha.",
)
def replicate_cmd(pretrain_only: bool, **kwargs: Any) -> None:
    """Re-run the GQA paper's experiments (Ainslie et al. 2023) on an MHA model pretrained here: which
    start (Fig. 4), how much uptraining (Fig. 5), how many groups (Fig. 6, Table 1), uptrained against
    trained from scratch; with gqakit's calibrated merge and its fast preset beside the paper's methods."""
    options = options_from(ReplicateOptions, kwargs)
    if pretrain_only:
        click.echo(f"MHA model: {pretrain_mha(options)}")
        return
    run_replicate(options)


__all__ = ["replicate_cmd"]
