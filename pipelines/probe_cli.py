"""``gqakit probe``: parse the options and call :func:`gqakit.pipelines.probe.probe_checkpoint`.

The probe itself is imported when the command runs, not when ``gqakit --help`` lists it.
"""

from __future__ import annotations

from pathlib import Path

import click

from gqakit.convert.api import CONVERT_METHODS


def _csv(kind: type, value: str, name: str) -> tuple:
    try:
        return tuple(kind(v.strip()) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a comma-separated list of {kind.__name__}", param_hint=name
        ) from None


@click.command("probe")
@click.argument("src")
@click.option("--groups", "-g", required=True, help="Comma-separated G values to try, e.g. 1,3.")
@click.option(
    "--methods",
    default="mean,first,calibrated",
    show_default=True,
    help=f"Comma-separated methods ({', '.join(CONVERT_METHODS)}).",
)
@click.option(
    "--grouping",
    default="contiguous",
    show_default=True,
    help="Comma-separated groupings (contiguous, similarity).",
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
@click.option("--device", default="auto", show_default=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="probe",
    show_default=True,
    help="Directory for probe.json, probe.md and probe.png.",
)
def probe_cmd(
    src: str,
    groups: str,
    methods: str,
    grouping: str,
    calib_data: str | None,
    eval_data: str,
    calib_tokens: int,
    eval_tokens: int,
    error_tokens: int,
    seq_len: int,
    batch_size: int,
    text_field: str,
    device: str,
    out_dir: str,
) -> None:
    """Zero-training quality of SRC for each G x method x grouping: held-out perplexity and per-layer
    attention-output error, as a table, a JSON file and a plot. Pick G before spending compute."""
    from gqakit.pipelines.probe import ProbeOptions, probe_checkpoint

    options = ProbeOptions(
        groups=_csv(int, groups, "--groups"),
        eval_data=eval_data,
        methods=_csv(str, methods, "--methods"),
        groupings=_csv(str, grouping, "--grouping"),
        calib_data=calib_data,
        calib_tokens=calib_tokens,
        eval_tokens=eval_tokens,
        error_tokens=error_tokens,
        seq_len=seq_len,
        batch_size=batch_size,
        text_field=text_field,
        device=device,
    )
    result = probe_checkpoint(src, out_dir, options)
    click.echo(result.to_table())
    click.echo(f"wrote {Path(out_dir) / 'probe.json'}, probe.md, probe.png")


__all__ = ["probe_cmd"]
