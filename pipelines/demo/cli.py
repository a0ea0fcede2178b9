"""``gqakit demo``: parse the options and call :func:`gqakit.pipelines.demo.run.run_demo`."""

from __future__ import annotations

from typing import Any

import click

from gqakit.cli_options import (
    cache_dir_option,
    device_option,
    dtype_option,
    fresh_option,
    out_option,
    progress_option,
    wheelhouse_option,
    work_dir_option,
)
from gqakit.models import DTYPES
from gqakit.pipelines.demo.options import RECIPE, DemoOptions
from gqakit.pipelines.demo.run import run_demo


@click.command("demo")
@work_dir_option("demo-work")
@out_option("demo-report", "Directory for report.md, results.json and the plots.", old="--report-dir")
@device_option()
@dtype_option(list(DTYPES), "auto", "Evaluation dtype; auto: float32 on CPU, bfloat16 on CUDA.")
@click.option(
    "--budget-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Multiply the recipe's uptraining budget (e.g. 6 for about an hour on 2 CPU cores).",
)
@click.option(
    "--eval-tokens",
    type=int,
    default=None,
    help="Test tokens scored per model [default: 8192 on CPU, all on GPU].",
)
@click.option(
    "--decode-context",
    type=int,
    default=None,
    help="Prompt tokens of the decode measurement [default: 512 on CPU, 2048 on GPU].",
)
@click.option(
    "--decode-rounds",
    type=int,
    default=5,
    show_default=True,
    help="Short interleaved rounds of the side-by-side decode measurement (the table shows each model's "
    "median and spread; no speedup when the rounds disagree).",
)
@click.option(
    "--recipe", default=RECIPE, show_default=True, help="Uptraining recipe (a path or a shipped name)."
)
@click.option(
    "--set",
    "recipe_overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Recipe override, e.g. --set train.lr=3e-4 (repeatable).",
)
@fresh_option()
@click.option(
    "--llamacpp/--no-llamacpp",
    default=True,
    help="Measure the llama.cpp decode column (when llama-cpp-python is installed).",
)
@click.option(
    "--vllm/--no-vllm",
    default=True,
    help="Measure the vLLM column (when $GQAKIT_VLLM_PYTHON or this Python has vLLM).",
)
@progress_option()
@cache_dir_option()
@wheelhouse_option()
def demo_cmd(**settings: Any) -> None:
    """Convert SmolLM2-135M to MHA, GQA and MQA, uptrain the MQA model, and report what it costs and buys."""
    # every parameter is named after its DemoOptions field, so the options name each problem's flag

    run_demo(DemoOptions(**settings))


__all__ = ["demo_cmd"]
