"""``gqakit demo``: the options of :class:`DemoOptions` as flags, then
:func:`gqakit.pipelines.demo.run.run_demo`."""

from __future__ import annotations

from typing import Any

import click

from gqakit.cli_options import click_options, options_from
from gqakit.pipelines.demo.options import DemoOptions
from gqakit.pipelines.demo.run import run_demo
from gqakit.pipelines.steps import set_option


@click.command("demo")
@click_options(DemoOptions)
@set_option(
    "Override both uptraining recipes (repeatable), e.g. --set train.lr=3e-4; "
    "model.convert.calib_tokens=... and model.convert.refine_* change the conversions that use them."
)
def demo_cmd(**kwargs: Any) -> None:
    """Convert SmolLM2-135M to MHA, GQA and MQA, uptrain the MQA model, and report what it costs and buys."""
    run_demo(options_from(DemoOptions, kwargs))


__all__ = ["demo_cmd"]
