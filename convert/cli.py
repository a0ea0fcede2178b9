"""Click commands for convert, expand and inspect: parse, call one typed function, print.

``gqakit probe`` converts and then evaluates, so it lives above the verbs: :mod:`gqakit.pipelines.probe.cli`.
"""

from __future__ import annotations

import click

from gqakit.cli_options import device_option, dtype_option, force_option, progress_option, seed_option
from gqakit.convert.api import (
    DTYPE_CHOICES,
    ConvertOptions,
    convert_checkpoint,
    expand_checkpoint,
    inspect_checkpoint,
)
from gqakit.convert.methods import GROUPINGS, METHODS
from gqakit.convert.refine import REFINE_LR, REFINE_QK_LR
from gqakit.convert.refine_names import REFINE_LOSSES, REFINE_SCHEDULES, REFINE_TARGETS

_STORAGE_DTYPE = "Output dtype of floating tensors (pooling runs in float32)."


@click.command("convert")
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--groups", "-g", type=int, required=True, help="K/V heads in the output (1 = MQA).")
@click.option(
    "--method",
    type=click.Choice(METHODS.names),
    default="mean",
    show_default=True,
    help=METHODS.describe()
    + ". Families that normalize keys per head (qwen3, gemma3, olmo2, stablelm/phi with qk_layernorm) "
    "fall back to mean for keys; values stay calibrated; gqakit.json records this as key_merge.",
)
@dtype_option(list(DTYPE_CHOICES), "keep", _STORAGE_DTYPE)
@seed_option("Seed for --method random.")
@click.option(
    "--calib-data",
    type=click.Path(dir_okay=False),
    default=None,
    help="Calibration text (.txt, .jsonl, .parquet) for --method calibrated and --grouping similarity.",
)
@click.option("--calib-tokens", type=int, default=4096, show_default=True, help="Calibration tokens to run.")
@click.option(
    "--grouping",
    type=click.Choice(GROUPINGS.names),
    default="contiguous",
    show_default=True,
    help=GROUPINGS.describe() + ".",
)
@click.option(
    "--refine-steps",
    type=int,
    default=0,
    show_default=True,
    help="After the merge, Adam steps per layer fitting each converted attention block (all its weights) "
    "to the original's output on --calib-data, keeping each layer's best step on held-out calibration "
    "text; 0: off. 200 take SmolLM2-135M -> MQA (calibrated) from test perplexity 91.9 to 30.9, in "
    "about 7 minutes on 2 CPU cores; 800 on --calib-tokens 32768 to 20.9 (the original: 15.9; both "
    "measured at one rate, --refine-qk-lr 1e-3).",
)
@click.option(
    "--refine-lr", type=float, default=REFINE_LR, show_default=True, help="Learning rate of --refine-steps."
)
@click.option(
    "--refine-target",
    type=click.Choice(REFINE_TARGETS.names),
    default="attention",
    show_default=True,
    help=f"What each converted attention block is fitted to: {REFINE_TARGETS.describe()} (docs/convert.md "
    "compares them).",
)
@click.option(
    "--refine-qk-lr",
    type=float,
    default=REFINE_QK_LR,
    show_default=True,
    help="Learning rate of the query/key side (q, k and their norms) in --refine-steps; the rest take "
    "--refine-lr, as does a fused qkv projection. Give the --refine-lr value for one rate throughout.",
)
@click.option(
    "--refine-schedule",
    type=click.Choice(REFINE_SCHEDULES.names),
    default="constant",
    show_default=True,
    help=f"How the --refine-steps rates change over each layer's steps: {REFINE_SCHEDULES.describe()}.",
)
@click.option(
    "--refine-loss",
    type=click.Choice(REFINE_LOSSES.names),
    default=None,
    help=f"How each --refine-steps batch's error is measured: {REFINE_LOSSES.describe()}. Default: the "
    f"target's own: per-token for {', '.join(REFINE_TARGETS.where(lambda t: t.loss == 'per-token'))} "
    "(lower with them on both models measured, docs/convert.md), relative for the others.",
)
@device_option()
@force_option()
@progress_option()
def convert_cmd(
    src: str,
    dst: str,
    groups: int,
    method: str,
    dtype: str,
    seed: int,
    calib_data: str | None,
    calib_tokens: int,
    grouping: str,
    refine_steps: int,
    refine_lr: float,
    refine_target: str,
    refine_qk_lr: float | None,
    refine_schedule: str,
    refine_loss: str | None,
    device: str,
    force: bool,
    progress: bool,
) -> None:
    """Convert SRC (directory, .gguf file or hub id) to GROUPS K/V heads in DST."""
    options = ConvertOptions(
        groups,
        method,
        dtype,
        seed,
        force,
        calib_data,
        calib_tokens,
        grouping,
        device,
        refine_steps=refine_steps,
        refine_lr=refine_lr,
        refine_target=refine_target,
        refine_qk_lr=refine_qk_lr,
        refine_schedule=refine_schedule,
        refine_loss=refine_loss,
    )
    res = convert_checkpoint(src, dst, options, progress=progress)
    extra = f", {grouping} grouping" if grouping != "contiguous" else ""
    if refine_steps:
        extra += f", refined {refine_steps} steps/layer"
    click.echo(
        f"{res.model_type}: {res.num_heads} query heads, K/V heads {res.from_kv_heads} -> {res.to_kv_heads} "
        f"({method}{extra}); {len(res.files)} shard(s) in {res.dst} ({res.elapsed_s:.1f}s)"
    )


@click.command("expand")
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@dtype_option(list(DTYPE_CHOICES), "keep", _STORAGE_DTYPE)
@force_option()
@progress_option()
def expand_cmd(src: str, dst: str, dtype: str, force: bool, progress: bool) -> None:
    """GQA/MQA -> MHA: repeat each K/V head over its group (exactly the same logits)."""
    res = expand_checkpoint(src, dst, dtype, force, progress=progress)
    click.echo(
        f"{res.model_type}: K/V heads {res.from_kv_heads} -> {res.to_kv_heads} (exact); wrote {res.dst}"
    )


@click.command("inspect")
@click.argument("src")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def inspect_cmd(src: str, as_json: bool) -> None:
    """Show SRC's attention geometry and the KV-cache bytes per token of each valid G."""
    info = inspect_checkpoint(src)
    click.echo(info.to_json() if as_json else info.to_text())
