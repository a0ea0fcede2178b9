"""``gqakit probe``: the options of :class:`ProbeOptions` as flags, then
:func:`gqakit.pipelines.probe.run.probe_checkpoint`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gqakit.cli_options import click_options, options_from, out_option
from gqakit.pipelines.probe.options import ProbeOptions
from gqakit.pipelines.probe.run import probe_checkpoint


@click.command("probe")
@click.argument("src")
@click_options(ProbeOptions)
@out_option("probe", "Directory for probe.json, probe.md and probe.png.")
def probe_cmd(src: str, out: Path, **kwargs: Any) -> None:
    """Zero-training quality of SRC for each G x method x grouping: held-out perplexity and per-layer
    attention-output error, as a table, a JSON file and a plot. Pick G before spending compute."""
    result = probe_checkpoint(src, out, options_from(ProbeOptions, kwargs))
    click.echo(result.to_table())
    click.echo(f"wrote {out / 'probe.json'}, probe.md, probe.png")


__all__ = ["probe_cmd"]
