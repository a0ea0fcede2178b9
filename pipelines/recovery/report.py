"""The recovery report: ``recovery.png``, ``report.md`` and ``results.json``."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit.eval.plots import figure
from gqakit.eval.report import md_table
from gqakit.pipelines.recovery.curves import THRESHOLDS, Curve, Reach, Saving, savings
from gqakit.pipelines.starts import conversion_key
from gqakit.pipelines.steps import fmt_duration, fmt_ppl, write_report
from gqakit.pipelines.store import ResultStore

if TYPE_CHECKING:
    from gqakit.pipelines.recovery.options import Inputs, RecoveryOptions

PLOT = "recovery.png"


def _axes(ax, curves: list[Curve], original: float, first: float, low: float, high: float) -> None:
    """One panel: the curves between ``low`` and ``high`` times the original, the thresholds as ticks."""
    for c in curves:
        xs, ys = zip(*c.ratios(original), strict=True)
        ax.plot(xs, ys, marker="o", markersize=3.5, label=c.start)
    ax.axhline(1.0, color="black", linewidth=1.2, label=f"original ({fmt_ppl(original)})")
    for t in THRESHOLDS:
        ax.axhline(t, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("symlog", linthresh=first)
    ax.set_xlim(left=0)
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    marks = (1, 1.05, 1.1, 1.2, 1.5, 2) if high < 3 else (1, 1.5, 2, 5, 10, 100, 1000, 10000, 100000)
    ax.set_yticks([t for t in marks if low <= t <= high])
    ax.yaxis.minorticks_off()
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}x")
    ax.set_xlabel("uptraining tokens (0, then log scale)")
    ax.grid(True, which="major", alpha=0.3)


def recovery_figure(original: float, curves: list[Curve], title: str) -> Any:
    """Perplexity / the original's against uptraining tokens, with an x axis that is log from the first
    step on and linear below it, so the start itself (0 tokens) is on the plot. A start far above the
    original gets a second panel: the whole range, beside the thresholds' range (0.95x-2.2x) enlarged."""
    first = min((t for c in curves for t, _ in c.points if t > 0), default=1)
    top = max(r for c in curves for _, r in c.ratios(original))
    wide = top > 2.5
    fig, axes = figure(1, 2 if wide else 1, figsize=(12 if wide else 7.5, 4.8), squeeze=False)
    _axes(axes[0][0], curves, original, first, 0.95, 2.2)
    axes[0][0].set_title("near the original: the thresholds" if wide else title, fontsize=10)
    axes[0][0].set_ylabel("held-out perplexity / original's")
    axes[0][0].legend(fontsize=8)
    if wide:
        _axes(axes[0][1], curves, original, first, 0.95, top * 1.3)
        axes[0][1].set_title("the whole range", fontsize=10)
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _with_label(x: Reach | Saving) -> dict[str, Any]:
    return {**asdict(x), "label": x.label()}


def _start_settings(o: RecoveryOptions, inputs: Inputs) -> dict[str, dict[str, Any]]:
    """Each start's conversion, as its cache keys it: the settings that made it."""
    out = {}
    for start in o.starts:
        key = conversion_key(o.start_options(start, inputs.calibration))
        out[start] = {k: v for k, v in key.items() if k not in ("groups", "calib_data", "seed")}
    return out


def _tables(curves: list[Curve], original: float, tokens: int) -> dict[str, str]:
    """The report's tables: tokens to reach each threshold, and the savings over the first start."""
    heads = [f"{t:g}x" for t in THRESHOLDS]
    rows = []
    for c in curves:
        p0, pn = c.points[0][1], c.points[-1][1]
        at = [f"{fmt_ppl(p0)} ({p0 / original:.2f}x)", f"{fmt_ppl(pn)} ({pn / original:.3f}x)"]
        rows.append([c.start, *at, *(c.reach[t].label() for t in THRESHOLDS)])
    saved = savings(curves)
    save_rows = [[start, *(by_t[t].label() for t in THRESHOLDS)] for start, by_t in saved.items()]
    return {
        "reach": md_table(["start", "at 0 tokens", f"at {tokens:,} tokens", *heads], rows),
        "savings": md_table(["start", *heads], save_rows) if saved else "",
    }


def write_recovery_report(
    o: RecoveryOptions,
    inputs: Inputs,
    recipe,
    original: float,
    curves: list[Curve],
    elapsed_s: float,
    store: ResultStore,
) -> tuple[Path, Path, Path]:
    """Write the three files into ``o.out``; return their paths (report, results, plot).

    Args:
        recipe: the runs' recipe (a start's, ``--set`` applied): what the settings section states.
    """
    tokens = o.steps * o.tokens_per_step
    title = f"{o.src} -> {o.groups} K/V heads: held-out perplexity during uptraining, by start"
    tables = _tables(curves, original, tokens)
    ref = curves[0].start
    savings_text = (
        f"How many times fewer uptraining tokens than {ref} each start needs to reach the "
        f'threshold; ">=" is a lower\nbound ({ref} never got there within the run, or the start '
        f'got there by its first point); "n/a" where the start never got there, or {ref} got there by '
        f"its\nfirst point (its tokens are then an upper bound).\n\n{tables['savings']}"
        if tables["savings"]
        else "Only one start was run: nothing to compare it with (list two or more in --starts; the first "
        "is the reference)."
    )
    time_rows = [
        f"- {c.start}: conversion {fmt_duration(c.convert_s)}, uptraining {fmt_duration(c.train_s)}"
        for c in curves
    ]
    figures_s = sum(c.convert_s + c.train_s for c in curves)
    starts = _start_settings(o, inputs)
    objective, seq_len, batch = recipe.objective.kind, recipe.data.seq_len, recipe.train.batch_size
    eval_tokens = recipe.data.max_val_blocks * seq_len
    conversions = "\n".join(
        f"- start {s}: " + ", ".join(f"{k} {v}" for k, v in kv.items()) for s, kv in starts.items()
    )
    overrides = ", ".join(o.recipe_sets) or "none"
    text = f"""# gqakit recovery: {o.src} -> {o.groups} K/V heads

How many uptraining tokens each start needs to come back to the original's quality. Each start is
converted from the original, then uptrained once for {tokens:,} tokens ({o.steps} steps of {batch} x
{seq_len} tokens; objective {objective}{" from the original" if objective == "distill" else ""};
peak learning rate {o.lr:g}: a warmup of {o.warmup_run} steps, then constant, so each point is what a
run stopped there gives), and scored on the held-out text at log-spaced token counts during that run.
Perplexity on {eval_tokens:,} held-out tokens in {seq_len}-token blocks, {recipe.train.precision};
the original scores **{fmt_ppl(original)}** the same way. Every measured point: `results.json`.

![recovery]({PLOT})

## Tokens to reach each multiple of the original's perplexity

Interpolated between measured points in log tokens; "<= N": reached by the first point, "> N": not reached
within the run.

{tables["reach"]}

## Savings over {ref}

{savings_text}

## Settings

- source: `{inputs.src}`; groups {o.groups}; starts {", ".join(o.starts)}
{conversions}
- text: train `{inputs.train}`, calibration `{inputs.calibration}`, held out `{inputs.heldout}`
- seed {o.seed}; precision {recipe.train.precision}; device {o.device}; recipe overrides: {overrides}
- wall time: the conversions and uptraining runs took {fmt_duration(figures_s)} together; this run of the
  command {fmt_duration(elapsed_s)} ({store.reused} results reused from `{o.work_dir}`)
{chr(10).join(time_rows)}
"""
    settings = {
        "tokens": tokens,
        "steps": o.steps,
        "tokens_per_step": o.tokens_per_step,
        "seq_len": seq_len,
        "batch_size": batch,
        "objective": objective,
        "precision": recipe.train.precision,
        "warmup_steps_run": o.warmup_run,
        "eval_tokens": eval_tokens,
        "starts": starts,
        "recipe_overrides": list(o.recipe_sets),
        "seed": o.seed,
        "data": o.data and str(o.data),
    }
    results: dict[str, Any] = {
        "source": str(inputs.src),
        "groups": o.groups,
        "settings": settings,
        "original_ppl": original,
        "thresholds": list(THRESHOLDS),
        "starts": {
            c.start: {
                "lr": o.lr,
                "points": [{"tokens": t, "ppl": p, "ratio": p / original} for t, p in c.points],
                "reach": {f"{t:g}": _with_label(c.reach[t]) for t in THRESHOLDS},
                "convert_s": round(c.convert_s, 1),
                "train_s": round(c.train_s, 1),
            }
            for c in curves
        },
        "reference": ref,
        "savings": {
            s: {f"{t:g}": _with_label(v) for t, v in by_t.items()} for s, by_t in savings(curves).items()
        },
        "elapsed_s": round(elapsed_s, 1),
    }
    figures = {PLOT: recovery_figure(original, curves, title)}
    report, results_json, [plot] = write_report(Path(o.out), text, results, figures)
    return report, results_json, plot
