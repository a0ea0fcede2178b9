"""The recovery report: ``recovery.png``, ``report.md`` and ``results.json``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit.models import cpu_model
from gqakit.pipelines.recovery.curves import THRESHOLDS, Curve, best_rates, savings
from gqakit.pipelines.reporting import (
    command_line,
    fmt_duration,
    fmt_ppl,
    md_table,
    pyplot,
    save_figure,
    versions,
    write_report,
)
from gqakit.pipelines.starts import conversion_key
from gqakit.pipelines.store import ResultStore
from gqakit.storage import make_dirs

if TYPE_CHECKING:
    from gqakit.pipelines.recovery.options import Inputs, RecoveryOptions

PLOT = "recovery.png"


def _axes(ax, plt, curves: list[Curve], original: float, first: float, low: float, high: float) -> None:
    """One panel: the curves between ``low`` and ``high`` times the original, the thresholds as ticks.
    A start's rates share its colour and differ in line style; the legend names each curve as the tables
    do."""
    starts = list(dict.fromkeys(c.start for c in curves))
    styles = ("-", "--", ":", "-.")
    for c in curves:
        xs, ys = zip(*c.ratios(original), strict=True)
        nth = [d.lr for d in curves if d.start == c.start].index(c.lr)
        ax.plot(
            xs, ys, marker="o", markersize=3.5, color=f"C{starts.index(c.start) % 10}",
            linestyle=styles[nth % len(styles)], label=c.label,
        )  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=1.2, label=f"original ({fmt_ppl(original)})")
    for t in THRESHOLDS:
        ax.axhline(t, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("symlog", linthresh=first)
    ax.set_xlim(left=0)
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    marks = (1, 1.05, 1.1, 1.2, 1.5, 2) if high < 3 else (1, 1.5, 2, 5, 10, 100, 1000, 10000, 100000)
    ax.set_yticks([t for t in marks if low <= t <= high])
    ax.yaxis.set_minor_locator(plt.NullLocator())
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("uptraining tokens (0, then log scale)")
    ax.grid(True, which="major", alpha=0.3)


def recovery_figure(original: float, curves: list[Curve], title: str) -> Any:
    """Perplexity / the original's against uptraining tokens, with an x axis that is log from the first
    step on and linear below it, so the start itself (0 tokens) is on the plot. A start far above the
    original gets a second panel: the whole range, beside the thresholds' range (0.95x-2.2x) enlarged."""
    plt = pyplot()
    first = min((t for c in curves for t, _ in c.points if t > 0), default=1)
    top = max(r for c in curves for _, r in c.ratios(original))
    wide = top > 2.5
    fig, axes = plt.subplots(1, 2 if wide else 1, figsize=(12 if wide else 7.5, 4.8), squeeze=False)
    _axes(axes[0][0], plt, curves, original, first, 0.95, 2.2)
    axes[0][0].set_title("near the original: the thresholds" if wide else title, fontsize=10)
    axes[0][0].set_ylabel("held-out perplexity / original's")
    axes[0][0].legend(fontsize=8)
    if wide:
        _axes(axes[0][1], plt, curves, original, first, 0.95, top * 1.3)
        axes[0][1].set_title("the whole range", fontsize=10)
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _start_settings(o: RecoveryOptions, inputs: Inputs) -> dict[str, dict[str, Any]]:
    """Each start's conversion, as its cache keys it: the settings that made it."""
    out = {}
    for start in o.starts:
        key = conversion_key(o.start_options(start, inputs.calibration))
        out[start] = {k: v for k, v in key.items() if k not in ("groups", "calib_data", "seed")}
    return out


def _tables(curves: list[Curve], original: float, tokens: int) -> dict[str, str]:
    """The report's tables: tokens to reach each threshold, savings over the first start, each start at
    its best rate (when a start has several), and every measured point."""
    heads = [f"{t:g}x" for t in THRESHOLDS]
    rows = []
    for c in curves:
        p0, pn = c.points[0][1], c.points[-1][1]
        at = [f"{fmt_ppl(p0)} ({p0 / original:.2f}x)", f"{fmt_ppl(pn)} ({pn / original:.3f}x)"]
        rows.append([c.label, f"{c.lr:g}", *at, *(c.reach[t].label() for t in THRESHOLDS)])
    saved = savings(curves)
    save_rows = [[start, *(by_t[t].label() for t in THRESHOLDS)] for start, by_t in saved.items()]
    best_rows = []
    for start, by_t in best_rates({(c.start, c.lr): c.reach for c in curves}).items():
        # a start already there needs no rate; one never there has no best rate
        cells = [
            f"{r.label()} (lr {lr:g})" if r.reached and r.tokens > 0 else r.label() for r, lr in by_t.values()
        ]
        best_rows.append([start, *cells])
    by_tokens: dict[int, dict[str, float]] = {}
    for c in curves:
        for t, p in c.points:
            by_tokens.setdefault(t, {})[c.label] = p
    point_rows = []
    for t in sorted(by_tokens):
        at_t = by_tokens[t]
        cells = [
            f"{fmt_ppl(at_t[c.label])} ({at_t[c.label] / original:.3f}x)" if c.label in at_t else ""
            for c in curves
        ]
        point_rows.append([f"{t:,}", *cells])
    return {
        "reach": md_table(["start", "lr", "at 0 tokens", f"at {tokens:,} tokens", *heads], rows),
        "savings": md_table(["start", *heads], save_rows) if saved else "",
        "best": md_table(["start", *heads], best_rows),
        "points": md_table(["tokens", *(c.label for c in curves)], point_rows),
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
    out = Path(o.out)
    make_dirs(out)
    tokens = o.steps * o.tokens_per_step
    title = f"{o.src} -> {o.groups} K/V heads: held-out perplexity during uptraining, by start"
    plot = save_figure(recovery_figure(original, curves, title), out / PLOT)
    tables = _tables(curves, original, tokens)
    swept = any(c.swept for c in curves)
    ref = curves[0].start
    at_best = (
        " (each start at its best\nmeasured rate for that threshold, in the table below)" if swept else ""
    )
    savings_text = (
        f"How many times fewer uptraining tokens than {ref} each start needs to reach the "
        f'threshold{at_best}; ">=" is a lower\nbound ({ref} never got there within the run, or the start '
        f'got there by its first point); "n/a" where the start never got there, or {ref} got there by '
        f"its\nfirst point (its tokens are then an upper bound).\n\n{tables['savings']}"
        if tables["savings"]
        else "Only one start was run: nothing to compare it with (list two or more in --starts; the first "
        "is the reference)."
    )
    if swept:
        savings_text += (
            "\n\nEach start at its best measured rate for each threshold: the fewest tokens any of its runs "
            "needed, and\nthat run's rate. A rate that gets there first can level off before a lower "
            f"threshold.\n\n{tables['best']}"
        )
        lr_note = "some starts at several peak learning rates, one run each (the lr column)"
    elif len({c.lr for c in curves}) == 1:
        lr_note = "every start at the same peak learning rate"
    else:
        lr_note = "each start at its own peak learning rate (the lr column), set with --start-lr"
    converted = {c.start: c.convert_s for c in curves}  # a start's rates share its one conversion
    time_rows = []
    for start, convert_s in converted.items():
        runs = [
            ("" if not c.swept else f"at lr {c.lr:g} ") + fmt_duration(c.train_s)
            for c in curves
            if c.start == start
        ]
        time_rows.append(f"- {start}: conversion {fmt_duration(convert_s)}, uptraining {', '.join(runs)}")
    figures_s = sum(converted.values()) + sum(c.train_s for c in curves)
    starts = _start_settings(o, inputs)
    objective, seq_len, batch = recipe.objective.kind, recipe.data.seq_len, recipe.train.batch_size
    eval_tokens = recipe.data.max_val_blocks * seq_len
    conversions = "\n".join(
        f"- start {s}: " + ", ".join(f"{k} {v}" for k, v in kv.items()) for s, kv in starts.items()
    )
    command, machine, versions_ = command_line(""), f"{cpu_model()}, {os.cpu_count()} CPUs", versions()
    once, overrides = "once per rate" if swept else "once", ", ".join(o.recipe_sets) or "none"
    text = f"""# gqakit recovery: {o.src} -> {o.groups} K/V heads

How many uptraining tokens each start needs to come back to the original's quality. Each start is
converted from the original, then uptrained {once} for {tokens:,} tokens ({o.steps} steps of {batch} x
{seq_len} tokens; objective {objective}{" from the original" if objective == "distill" else ""};
{lr_note}: a warmup of {o.warmup_run} steps, then constant, so each point is what a run stopped there
gives), and scored on the held-out text at log-spaced token counts during that run. Perplexity on
{eval_tokens:,} held-out tokens in {seq_len}-token blocks, {recipe.train.precision};
the original scores **{fmt_ppl(original)}** the same way.

![recovery]({PLOT})

## Tokens to reach each multiple of the original's perplexity

Interpolated between measured points in log tokens; "<= N": reached by the first point, "> N": not reached
within the run.

{tables["reach"]}

## Savings over {ref}

{savings_text}

## Every measured point

Held-out perplexity (and its multiple of the original's) after each number of uptraining tokens.

{tables["points"]}

## Settings

- source: `{inputs.src}`; groups {o.groups}; starts {", ".join(o.starts)}
{conversions}
- text: train `{inputs.train}`, calibration `{inputs.calibration}`, held out `{inputs.heldout}`
- seed {o.seed}; precision {recipe.train.precision}; device {o.device}; recipe overrides: {overrides}
- wall time: the conversions and uptraining runs took {fmt_duration(figures_s)} together; this run of the
  command {fmt_duration(elapsed_s)} ({store.reused} results reused from `{o.work_dir}`)
{chr(10).join(time_rows)}
- machine: {machine}; {", ".join(f"{k} {v}" for k, v in versions_.items())}
- command: `{command}`

Machine-readable figures: `results.json`.
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
        "command": command,
        "source": str(inputs.src),
        "groups": o.groups,
        "settings": settings,
        "original_ppl": original,
        "thresholds": list(THRESHOLDS),
        "starts": {
            c.label: {
                "start": c.start,
                "lr": c.lr,
                "points": [{"tokens": t, "ppl": p, "ratio": p / original} for t, p in c.points],
                "reach": {f"{t:g}": c.reach[t].as_dict() for t in THRESHOLDS},
                "convert_s": round(c.convert_s, 1),
                "train_s": round(c.train_s, 1),
            }
            for c in curves
        },
        "reference": ref,
        "best_rates": {
            start: {f"{t:g}": {"lr": lr, **r.as_dict()} for t, (r, lr) in by_t.items()}
            for start, by_t in best_rates({(c.start, c.lr): c.reach for c in curves}).items()
        },
        "savings": {
            s: {f"{t:g}": v.as_dict() for t, v in by_t.items()} for s, by_t in savings(curves).items()
        },
        "elapsed_s": round(elapsed_s, 1),
        "machine": machine,
        "versions": versions_,
    }
    report, results_json = write_report(out, text, results)
    return report, results_json, plot
