"""The demo pipeline: :func:`run_demo` runs the seven steps (see :mod:`gqakit.pipelines.demo`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click

from gqakit.assets import fetch_asset
from gqakit.checkpoint import read_config
from gqakit.cli_options import click_options, options_from
from gqakit.convert import convert_checkpoint, expand_checkpoint
from gqakit.geometry import AttentionGeometry
from gqakit.pipelines.demo.measure import (
    ModelEval,
    Settings,
    decode_side_by_side,
    eval_options,
    evaluate,
    max_logit_diff,
    resolve_settings,
)
from gqakit.pipelines.demo.options import (
    KV_TOKENS,
    SMOLLM2,
    VARIANTS,
    DemoAssets,
    DemoOptions,
    Variant,
    load_demo_recipe,
)
from gqakit.pipelines.demo.report import render_table, write_demo_report
from gqakit.pipelines.starts import conversion_key, convert_options_for
from gqakit.pipelines.steps import (
    Steps,
    kv_label,
    pipeline_run,
    set_option,
    train_once,
    weights_key,
    wiki_splits,
)
from gqakit.pipelines.store import ResultStore, fingerprint
from gqakit.problems import check_options
from gqakit.text import load_texts

STEPS = 7


@dataclass
class DemoResult:
    """What :func:`run_demo` measured and wrote.

    Attributes:
        original: the original model's evaluation (step 2).
        rows: the table, in order: MHA baseline, each variant (and its uptrained form).
        checks: the exactness checks: max |logit difference| of MHA vs original and G=original vs
            original, on a batch of test text.
        uptrain: the uptraining runs' summaries, by variant slug.
        report: ``report.md``.
        results_json: every figure, machine-readable.
        plots: the PNG files.
        settings: the resolved settings (device, dtype, eval tokens, decode point).
        elapsed_s: the demo's wall time.
    """

    original: ModelEval
    rows: list[ModelEval]
    checks: dict[str, float]
    uptrain: dict[str, dict[str, Any]]
    report: Path
    results_json: Path
    plots: list[Path]
    settings: dict[str, Any]
    elapsed_s: float


def fetch_demo_assets(options: DemoOptions) -> DemoAssets:
    """Step 1: SmolLM2-135M and the wiki-en splits, from the asset cache (fetched once)."""
    return DemoAssets(fetch_asset(SMOLLM2, options.cache_dir)["model"], *wiki_splits(options))


def _variant_label(v: Variant, g0: int, heads: int) -> str:
    return f"{kv_label(v.groups or g0, heads)} ({v.start})"


def _uptrain(
    options: DemoOptions,
    s: Settings,
    assets: DemoAssets,
    variant: Variant,
    student: Path,
    out: Path,
    store: ResultStore,
    steps: Steps,
) -> dict[str, Any]:
    """Uptrain ``student`` (distilling from the original) unless the same run already finished."""
    recipe = load_demo_recipe(options, assets, student, assets.model, out, variant.recipe)
    if s.device.startswith("cuda") and recipe.train.precision == "fp32":
        recipe.train.precision = "bf16"
    key = {"student": fingerprint(student), "recipe": weights_key(recipe.to_dict())}
    budget = {k: v for k, v in asdict(recipe.budget).items() if v is not None and k != "pretraining_tokens"}
    extra = {
        "output_dir": str(out),
        "budget": budget,
        "objective": recipe.objective.kind,
        "recipe": variant.recipe,
    }
    summary, reused = train_once(store, "uptrain-" + out.name, recipe, key, extra=extra)
    if reused:
        steps.note(f"reusing {out} ({summary['steps']} steps, {summary['tokens']:,} tokens)")
    return summary


def run_demo(options: DemoOptions | None = None) -> DemoResult:
    """Run the demo's seven steps and write its report. See the module docstring.

    Args:
        options: what to run and where; defaults reproduce the README's figures.

    Returns:
        A :class:`DemoResult`; the report is at ``result.report``.
    """
    options = check_options(options or DemoOptions(), "demo")
    with pipeline_run(options) as (work, store):
        return _run_demo(options, work, store)


def _run_demo(options: DemoOptions, work: Path, store: ResultStore) -> DemoResult:
    """:func:`run_demo` once its options are valid and it holds the working directory ``work``."""
    models = work / "models"
    steps = Steps(STEPS, options.echo)
    s = resolve_settings(options)
    options.echo(
        f"gqakit demo: device {s.device}, {s.dtype}; working directory {work} "
        f"(perplexity on {s.eval_tokens or 'all'} test tokens, decode at batch {s.decode_batch}, "
        f"context {s.decode_context})"
    )

    with steps.step("Assets: the pretrained model and the text (cached after the first run)"):
        assets = (options.assets or fetch_demo_assets)(options)
        steps.note(f"model {assets.model}")
        steps.note(f"text  {assets.test.parent}")
        texts = load_texts(assets.test)
        eval_opts = eval_options(s, assets.test, options.progress)

    geom = AttentionGeometry.from_config(read_config(assets.model))
    heads, g0 = geom.num_heads, geom.num_kv_heads

    with steps.step(f"Evaluate the original model ({kv_label(g0, heads)}, {heads} query heads)"):
        original = evaluate(f"original ({kv_label(g0, heads)})", assets.model, eval_opts, s, store, steps)

    checks: dict[str, float] = {}

    def exact(label: str, path: Path) -> None:
        """The exactness check of a model that must reproduce the original's logits."""
        checks[f"{label} vs original"] = diff = max_logit_diff(assets.model, path, texts, s, store)
        steps.note(f"{label}: max |logit difference| vs the original: {diff:.3g}")

    mha_dir = models / f"mha-{heads}"
    with steps.step(f"Expand {kv_label(g0, heads)} -> MHA-{heads}: the exactly equivalent MHA baseline"):
        expand = partial(expand_checkpoint, assets.model, mha_dir, force=True, progress=options.progress)
        store.build_once(mha_dir, {"source": fingerprint(assets.model)}, expand)
        exact(f"MHA-{heads}", mha_dir)
        mha = evaluate(f"MHA-{heads} (expanded)", mha_dir, eval_opts, s, store, steps)
        rows = [mha]

    uptrain_jobs: list[tuple[Variant, Path, str]] = []
    with steps.step(f"Convert MHA-{heads} -> " + ", ".join(_variant_label(v, g0, heads) for v in VARIANTS)):
        for v in VARIANTS:
            g = v.groups or g0
            dst = models / v.slug
            conv = convert_options_for(
                v.start, g, calib_data=str(assets.train), sets=options.sets, device=s.device
            )
            key = {"source": fingerprint(mha_dir), "options": conversion_key(conv)}
            store.build_once(
                dst, key, partial(convert_checkpoint, mha_dir, dst, conv, progress=options.progress)
            )
            label = _variant_label(v, g0, heads)
            if g == g0:
                exact(label, dst)
            suffix = ", before uptraining" if v.uptrain else ""
            rows.append(evaluate(label + suffix, dst, eval_opts, s, store, steps))
            if v.uptrain:
                uptrain_jobs.append((v, dst, label))

    uptrained: dict[str, dict[str, Any]] = {}
    with steps.step("Uptrain " + ", ".join(label for _, _, label in uptrain_jobs) + " with their recipes"):
        for v, dst, label in uptrain_jobs:
            out = models / f"{v.slug}-uptrained"
            uptrained[v.slug] = {"label": label, **_uptrain(options, s, assets, v, dst, out, store, steps)}
            rows.append(evaluate(f"{label}, after uptraining", out, eval_opts, s, store, steps))

    with steps.step(
        f"Decode speed (batch {s.decode_batch}, context {s.decode_context}), every model side by side: "
        f"{s.decode_rounds} short interleaved rounds, median and spread"
    ):
        decode_side_by_side([original, *rows], s, store, steps)

    with steps.step("Report"):
        settings = {
            **asdict(s),
            "kv_tokens": KV_TOKENS,
            "source": str(assets.model),
            "test": str(assets.test),
            "reused": store.reused,
            # what the results shown took to compute, whichever run computed them (each records its own)
            "compute_s": round(store.compute_time(), 1),
        }
        report, results_json, plots = write_demo_report(
            Path(options.out).resolve(), original, rows, checks, uptrained, settings, steps.elapsed
        )
    options.echo(f"\n{render_table(rows, s.decode_batch, s.decode_context, s.dtype)}\n")
    options.echo(f"Report: {report}")
    return DemoResult(original, rows, checks, uptrained, report, results_json, plots, settings, steps.elapsed)


@click.command("demo")
@click_options(DemoOptions)
@set_option(
    "Override both uptraining recipes (repeatable), e.g. --set train.lr=3e-4; "
    "model.convert.calib_tokens=... and model.convert.refine_* change the conversions that use them."
)
def demo_cmd(**kwargs: Any) -> None:
    """Convert SmolLM2-135M to MHA, GQA and MQA, uptrain the MQA model, and report what it costs and buys."""
    run_demo(options_from(DemoOptions, kwargs))
