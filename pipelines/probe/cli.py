"""``gqakit probe``: parse the options and call :func:`gqakit.pipelines.probe.run.probe_checkpoint`."""

from __future__ import annotations

from pathlib import Path

import click

from gqakit.cli_options import device_option, list_option, out_option
from gqakit.convert.methods import GROUPINGS, METHODS
from gqakit.pipelines.probe.options import ProbeOptions
from gqakit.pipelines.probe.run import probe_checkpoint


@click.command("probe")
@click.argument("src")
@list_option("--groups", "-g", kind=int, required=True, help="Comma-separated G values to try, e.g. 1,3.")
@list_option(
    "--methods",
    default="mean,first,calibrated",
    help=f"Comma-separated conversion methods ({', '.join(METHODS)}).",
)
@list_option(
    "--grouping",
    "groupings",
    default="contiguous",
    help=f"Comma-separated head groupings ({', '.join(GROUPINGS)}).",
)
@click.option(
    "--calib-data",
    type=click.Path(dir_okay=False),
    default=None,
    help="Calibration text, for calibrated and similarity.",
)
@click.option("--eval-data", type=click.Path(dir_okay=False), required=True, help="Held-out text.")
@click.option("--calib-tokens", type=int, default=4096, show_default=True)
@click.option(
    "--eval-tokens", type=int, default=16384, show_default=True, help="Held-out tokens for perplexity."
)
@click.option(
    "--error-tokens",
    type=int,
    default=2048,
    show_default=True,
    help="Held-out tokens for the per-layer attention-output errors.",
)
@click.option("--seq-len", type=int, default=256, show_default=True, help="Perplexity window.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--text-field", default="text", show_default=True, help="Column of .jsonl/.parquet data.")
@device_option()
@out_option("probe", "Directory for probe.json, probe.md and probe.png.")
def probe_cmd(src: str, out: Path, **settings: object) -> None:
    """Zero-training quality of SRC for each G x method x grouping: held-out perplexity and per-layer
    attention-output error, as a table, a JSON file and a plot. Pick G before spending compute."""
    # every other parameter is named after its ProbeOptions field, so the options name each flag
    result = probe_checkpoint(src, out, ProbeOptions(**settings))  # type: ignore[arg-type]
    click.echo(result.to_table())
    click.echo(f"wrote {out / 'probe.json'}, probe.md, probe.png")


__all__ = ["probe_cmd"]
