"""``gqakit recovery``: parse the options, run :func:`gqakit.pipelines.recovery.run.run_recovery`."""

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
    seed_option,
    wheelhouse_option,
    work_dir_option,
)
from gqakit.convert.refine_names import REFINE_LOSSES, REFINE_SCHEDULES, REFINE_TARGETS
from gqakit.pipelines.recovery.options import DEFAULT_STARTS, OBJECTIVES, PRECISIONS, RecoveryOptions
from gqakit.pipelines.recovery.run import run_recovery
from gqakit.pipelines.starts import STARTS

_D = RecoveryOptions.__dataclass_fields__


def _default(name: str) -> Any:
    return _D[name].default


@click.command("recovery")
@click.argument("src")
@click.option("--groups", type=int, required=True, help="K/V heads after conversion (1 = MQA).")
@click.option(
    "--data",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="One text file, one document per line, split into training, calibration and held-out text "
    "[default: the wiki-en asset's train / validation / test splits].",
)
@click.option(
    "--tokens", type=int, default=_default("tokens"), show_default=True, help="Uptraining tokens per start."
)
@list_option(
    "--starts",
    default=",".join(DEFAULT_STARTS),
    help="Starts, one curve each; the first is the reference of the savings: " + STARTS.describe() + ".",
)
@click.option("--lr", type=float, default=_default("lr"), show_default=True, help="Peak learning rate.")
@click.option(
    "--start-lr",
    multiple=True,
    metavar="START=LR[,LR...]",
    help="A start's own peak learning rate (repeatable), e.g. --start-lr mean=5e-4; several rates make one "
    "run each and the savings take each start's best per threshold, e.g. --start-lr refined=1e-4,4e-4.",
)
@click.option(
    "--objective",
    type=click.Choice(OBJECTIVES),
    default=_default("objective"),
    show_default=True,
    help="distill: KL to the original; lm: next-token cross-entropy.",
)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default=_default("precision"),
    show_default=True,
    help="auto: bf16 autocast where the CPU or GPU has bf16 instructions, else fp32 (weights stay fp32).",
)
@click.option("--seq-len", type=int, default=_default("seq_len"), show_default=True, help="Tokens per block.")
@click.option(
    "--batch-size", type=int, default=_default("batch_size"), show_default=True, help="Blocks per step."
)
@click.option(
    "--warmup-steps",
    type=int,
    default=_default("warmup_steps"),
    show_default=True,
    help="Linear warmup steps (at most half the run); the learning rate is constant after them.",
)
@click.option(
    "--evals-per-decade",
    type=int,
    default=_default("evals_per_decade"),
    show_default=True,
    help="Held-out evaluations per factor of ten tokens.",
)
@click.option(
    "--eval-tokens",
    type=int,
    default=_default("eval_tokens"),
    show_default=True,
    help="Held-out tokens per evaluation.",
)
@click.option(
    "--calib-tokens",
    type=int,
    default=_default("calib_tokens"),
    show_default=True,
    help="Calibration tokens of the calibrated and refined starts.",
)
@click.option(
    "--refine-steps",
    type=int,
    default=_default("refine_steps"),
    show_default=True,
    help="Refinement steps per layer of the refined start.",
)
@click.option(
    "--refine-target",
    type=click.Choice(REFINE_TARGETS.names),
    default=_default("refine_target"),
    show_default=True,
    help="What the refined start's blocks are fitted to (gqakit convert --refine-target).",
)
@click.option(
    "--refine-qk-lr",
    type=float,
    default=_default("refine_qk_lr"),
    show_default=True,
    help="The refined start's query/key-side refinement rate (gqakit convert --refine-qk-lr).",
)
@click.option(
    "--refine-schedule",
    type=click.Choice(REFINE_SCHEDULES.names),
    default=_default("refine_schedule"),
    show_default=True,
    help="How the refined start's refinement rates change over each layer's steps (gqakit convert "
    "--refine-schedule).",
)
@click.option(
    "--refine-loss",
    type=click.Choice(REFINE_LOSSES.names),
    default=_default("refine_loss"),
    help="How the refined start's refinement measures each batch's error (gqakit convert --refine-loss; "
    "default: the target's own).",
)
@click.option(
    "--checkpoint-every",
    type=int,
    default=_default("checkpoint_every"),
    show_default=True,
    help="Steps between resumable checkpoints of each run (a killed run resumes there).",
)
@out_option("recovery-report", "Directory for recovery.png, report.md and results.json.")
@work_dir_option("recovery-work")
@fresh_option()
@device_option()
@seed_option("Seed of the data order and of the random start.")
@progress_option()
@cache_dir_option()
@wheelhouse_option()
def recovery_cmd(**settings: Any) -> None:
    """Convert SRC (a checkpoint directory, a hub id or an asset name such as smollm2-135m) to --groups
    K/V heads from each start, uptrain each on the same data, and report how many tokens each needs to
    reach 2x, 1.5x, 1.2x, 1.1x and 1.05x the original's held-out perplexity, and what each start saves
    over the first. Cached and resumable in --work-dir: a rerun takes seconds."""
    # every parameter is named after its RecoveryOptions field, so the options name each flag
    run_recovery(RecoveryOptions(**settings))


__all__ = ["recovery_cmd"]
