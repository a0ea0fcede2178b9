"""Click commands for convert, expand and inspect: parse, call one typed function, print.

``gqakit probe`` converts and then evaluates, so it lives above the verbs: :mod:`gqakit.pipelines.probe.run`.
"""

from __future__ import annotations

import click

from gqakit.cli_options import click_options, options_from
from gqakit.convert.api import convert_checkpoint, expand_checkpoint, inspect_checkpoint
from gqakit.convert.options import DEFAULT_PRESET, DTYPE_CHOICES, DTYPE_HELP, ConvertOptions
from gqakit.convert.write import ConvertResult


@click.command("convert")
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@click_options(ConvertOptions)
@click.option("--progress/--no-progress", default=True, help="Show progress bars of the long steps.")
def convert_cmd(src: str, dst: str, progress: bool, **kwargs) -> None:
    """Convert SRC (directory, .gguf file or hub id) to GROUPS K/V heads in DST."""
    options = options_from(ConvertOptions, kwargs)
    click.echo(summary(convert_checkpoint(src, dst, options, progress=progress)))


def summary(res: ConvertResult) -> str:
    """convert's one line: the heads, the preset (other than the default) and method, what refinement
    kept, the output."""
    rec = res.provenance
    how = [f"preset {rec['preset']}"] if rec.get("preset", DEFAULT_PRESET) != DEFAULT_PRESET else []
    how.append(rec["method"])
    if "refine" in rec:
        how.append(rec["refine"]["summary"])
    return (
        f"{res.model_type}: {res.num_heads} query heads, K/V heads {res.from_kv_heads} -> {res.to_kv_heads} "
        f"({', '.join(how)}); {len(res.files)} shard(s) in {res.dst} ({res.elapsed_s:.1f}s)"
    )


@click.command("expand")
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="keep", show_default=True, help=DTYPE_HELP)
@click.option("--force", is_flag=True, help="Replace DST if it exists and is not empty.")
@click.option("--progress/--no-progress", default=True, help="Show progress bars of the long steps.")
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
