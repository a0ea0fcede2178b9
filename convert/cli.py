"""Click commands for convert, expand and inspect: parse, call one typed function, print."""

from __future__ import annotations

import click

from gqakit.convert.api import (
    DTYPE_CHOICES,
    ConvertOptions,
    convert_checkpoint,
    expand_checkpoint,
    inspect_checkpoint,
)
from gqakit.convert.pooling import METHODS


@click.command("convert")
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--groups", "-g", type=int, required=True, help="K/V heads in the output (1 = MQA).")
@click.option(
    "--method",
    type=click.Choice(METHODS),
    default="mean",
    show_default=True,
    help="mean: average each group (the paper); first: keep its first head; random: fresh init.",
)
@click.option(
    "--dtype",
    type=click.Choice(list(DTYPE_CHOICES)),
    default="keep",
    show_default=True,
    help="Output dtype of floating tensors (pooling runs in float32).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --method random.")
@click.option("--force", is_flag=True, help="Replace DST if it exists and is not empty.")
def convert_cmd(src: str, dst: str, groups: int, method: str, dtype: str, seed: int, force: bool) -> None:
    """Convert SRC (directory, .gguf file or hub id) to GROUPS K/V heads in DST."""
    res = convert_checkpoint(src, dst, ConvertOptions(groups, method, dtype, seed, force))
    click.echo(
        f"{res.model_type}: {res.num_heads} query heads, K/V heads {res.from_kv_heads} -> {res.to_kv_heads} "
        f"({method}); {len(res.files)} shard(s) in {res.dst} ({res.elapsed_s:.1f}s)"
    )


@click.command("expand")
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(list(DTYPE_CHOICES)), default="keep", show_default=True)
@click.option("--force", is_flag=True, help="Replace DST if it exists and is not empty.")
def expand_cmd(src: str, dst: str, dtype: str, force: bool) -> None:
    """GQA/MQA -> MHA: repeat each K/V head over its group (exactly the same logits)."""
    res = expand_checkpoint(src, dst, dtype, force)
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
