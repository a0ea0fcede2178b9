"""The recovery report: ``recovery.png``, ``report.md`` and ``results.json``."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from gqakit import __version__
from gqakit.convert import ConvertOptions
from gqakit.models import cpu_model
from gqakit.pipelines.recovery.curves import THRESHOLDS, Curve, best_rates, savings
from gqakit.pipelines.recovery.options import Inputs, RecoveryOptions
from gqakit.pipelines.reporting import fmt_duration, fmt_ppl, pyplot, save_figure
from gqakit.pipelines.starts import REFINED, start_convert_options
from gqakit.pipelines.store import ResultStore

PLOT = "recovery.png"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _axes(ax, plt, curves: list[Curve], original: float, first: float, low: float, high: float) -> None:
    """One panel: the curves between ``low`` and ``high`` times the original, the thresholds as ticks.
    A start's rates share its colour and differ in line style."""
    starts = list(dict.fromkeys(c.start for c in curves))
    styles = ("-", "--", ":", "-.")
    for c in curves:
        xs, ys = zip(*c.ratios(original), strict=True)
        nth = [d.lr for d in curves if d.start == c.start].index(c.lr)
        ax.plot(
            xs, ys, marker="o", markersize=3.5, color=f"C{starts.index(c.start) % 10}",
            linestyle=styles[nth % len(styles)], label=f"{c.start} (lr {c.lr:g})",
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


def plot_curves(original: float, curves: list[Curve], path: Path, title: str) -> Path:
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
    return save_figure(fig, path)


def write_report(
    o: RecoveryOptions,
    inputs: Inputs,
    precision: str,
    original: float,
    curves: list[Curve],
    elapsed_s: float,
    store: ResultStore,
) -> tuple[Path, Path, Path]:
    """Write the three files into ``o.out``; return their paths (report, results, plot)."""
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = o.steps * o.tokens_per_step
    plot = plot_curves(original, curves, out / PLOT, f"{o.src} -> {o.groups} K/V heads: recovery by start")
    saved = savings(curves)
    best = best_rates({(c.start, c.lr): c.reach for c in curves})
    swept = any(c.swept for c in curves)
    ref = curves[0].start
    command = "gqakit recovery " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 else ""
    machine = f"{cpu_model()}, {os.cpu_count()} CPUs"
    # the rates the refined start is converted with: those of the options that convert it
    refined = start_convert_options(
        REFINED, o.groups, calib_data=None, calib_tokens=o.calib_tokens, refine_steps=o.refine_steps,
        refine=o.refine,
    )  # fmt: skip
    rates = f"{refined.refine_lr:g}, query/key {refined.refine_qk_lr or refined.refine_lr:g}"
    # named only where they differ from a default conversion's, so that reports of default runs render as
    # before (a target's own loss is named: it is not the default target's)
    default = ConvertOptions(o.groups)
    choices = "".join(
        f", {what}" for what, on in (
            (f"fitted to {refined.refine_target}", refined.refine_target != default.refine_target),
            (f"{refined.refine_schedule} schedule", refined.refine_schedule != default.refine_schedule),
            (f"{refined.refine_loss_used} loss", refined.refine_loss_used != default.refine_loss_used),
        ) if on
    )  # fmt: skip
    versions = {
        "gqakit": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }

    head = "| start | lr | at 0 tokens | at " + f"{tokens:,}" + " tokens | " + " | ".join(
        f"{t:g}x" for t in THRESHOLDS
    ) + " |"  # fmt: skip
    rows = [head, "|---|---:|---:|---:|" + "---:|" * len(THRESHOLDS)]
    for c in curves:
        p0, pn = c.points[0][1], c.points[-1][1]
        cells = " | ".join(c.reach[t].label() for t in THRESHOLDS)
        rows.append(
            f"| {c.label} | {c.lr:g} | {fmt_ppl(p0)} ({p0 / original:.2f}x) | {fmt_ppl(pn)} "
            f"({pn / original:.3f}x) | {cells} |"
        )
    save_rows = ["| start | " + " | ".join(f"{t:g}x" for t in THRESHOLDS) + " |",
                 "|---|" + "---:|" * len(THRESHOLDS)]  # fmt: skip
    for start, by_t in saved.items():
        save_rows.append(f"| {start} | " + " | ".join(by_t[t].label() for t in THRESHOLDS) + " |")
    at_best = (
        " (each start at its best\nmeasured rate for that threshold, in the table below)" if swept else ""
    )
    savings_text = (
        f"How many times fewer uptraining tokens than {ref} each start needs to reach the "
        f'threshold{at_best}; ">=" is a lower\nbound ({ref} never got there within the run, or the start '
        f'got there by its first point); "n/a" where the start never got there, or {ref} got there by '
        f"its\nfirst point (its tokens are then an upper bound).\n\n{chr(10).join(save_rows)}"
        if saved
        else "Only one start was run: nothing to compare it with (list two or more in --starts; the first "
        "is the reference)."
    )
    point_rows = ["| tokens | " + " | ".join(c.label for c in curves) + " |"]
    point_rows.append("|---:|" + "---:|" * len(curves))
    by_tokens: dict[int, dict[str, float]] = {}
    for c in curves:
        for t, p in c.points:
            by_tokens.setdefault(t, {})[c.label] = p
    for t in sorted(by_tokens):
        cells = [
            f"{fmt_ppl(by_tokens[t][c.label])} ({by_tokens[t][c.label] / original:.3f}x)"
            if c.label in by_tokens[t] else "" for c in curves
        ]  # fmt: skip
        point_rows.append(f"| {t:,} | " + " | ".join(cells) + " |")
    converted = {c.start: c.convert_s for c in curves}  # a start's rates share its one conversion
    time_rows = []
    for start, convert_s in converted.items():
        runs = [
            ("" if not c.swept else f"at lr {c.lr:g} ")
            + fmt_duration(c.train_s)
            + (" (after a resume; the part before it is not counted)" if c.resumed else "")
            for c in curves
            if c.start == start
        ]
        time_rows.append(f"- {start}: conversion {fmt_duration(convert_s)}, uptraining {', '.join(runs)}")
    figures_s = sum(converted.values()) + sum(c.train_s for c in curves)
    if swept:
        lr_note = "some starts at several peak learning rates, one run each (the lr column)"
    elif len({c.lr for c in curves}) == 1:
        lr_note = "every start at the same peak learning rate"
    else:
        lr_note = "each start at its own peak learning rate (the lr column), set with --start-lr"
    best_text = ""
    if swept:
        best_rows = [
            "| start | " + " | ".join(f"{t:g}x" for t in THRESHOLDS) + " |",
            "|---|" + "---:|" * len(THRESHOLDS),
        ]
        for start, by_t in best.items():
            # a start already there needs no rate; one never there has no best rate
            cells = [
                f"{r.label()} (lr {lr:g})" if r.reached and r.tokens > 0 else r.label()
                for r, lr in by_t.values()
            ]
            best_rows.append(f"| {start} | " + " | ".join(cells) + " |")
        best_text = (
            "\n\nEach start at its best measured rate for each threshold: the fewest tokens any of its runs "
            "needed, and\nthat run's rate. A rate that gets there first can level off before a lower "
            f"threshold.\n\n{chr(10).join(best_rows)}"
        )
    once = "once per rate" if swept else "once"
    # the warmup each run took: a --warmup-steps over half the run is cut to half (RecoveryOptions)
    warmup = f"{o.warmup_run} steps"
    if o.warmup_run != o.warmup_steps:
        warmup += f" (--warmup-steps {o.warmup_steps}, cut to half the run)"
    text = f"""# gqakit recovery: {o.src} -> {o.groups} K/V heads

How many uptraining tokens each start needs to come back to the original's quality. Each start is
converted from the original, then uptrained {once} for {tokens:,} tokens ({o.steps} steps of {o.batch_size} x
{o.seq_len} tokens; objective {o.objective}{" from the original" if o.objective == "distill" else ""};
{lr_note}: a warmup of {warmup}, then constant, so each point is what a run stopped there
gives), and scored on the held-out text at log-spaced token counts during that run. Perplexity on
{max(1, o.eval_tokens // o.seq_len) * o.seq_len:,} held-out tokens in {o.seq_len}-token blocks, {precision};
the original scores **{fmt_ppl(original)}** the same way.

![recovery]({PLOT})

## Tokens to reach each multiple of the original's perplexity

Interpolated between measured points in log tokens; "<= N": reached by the first point, "> N": not reached
within the run.

{chr(10).join(rows)}

## Savings over {ref}

{savings_text}{best_text}

## Every measured point

Held-out perplexity (and its multiple of the original's) after each number of uptraining tokens.

{chr(10).join(point_rows)}

## Settings

- source: `{inputs.src}`; groups {o.groups}; starts {", ".join(o.starts)} (calibration {o.calib_tokens:,}
  tokens, refinement {o.refine_steps} steps per layer at {rates}{choices})
- text: train `{inputs.train}`, calibration `{inputs.calibration}`, held out `{inputs.heldout}`
- seed {o.seed}; precision {precision}; device {o.device}
- wall time: the conversions and uptraining runs took {fmt_duration(figures_s)} together; this run of the
  command {fmt_duration(elapsed_s)} ({store.reused} results reused from `{o.work_dir}`)
{chr(10).join(time_rows)}
- machine: {machine}; {", ".join(f"{k} {v}" for k, v in versions.items())}
- command: `{command}`

Machine-readable figures: `results.json`.
"""
    report = out / "report.md"
    _write(report, text)
    results: dict[str, Any] = {
        "command": command,
        "source": str(inputs.src),
        "groups": o.groups,
        "settings": {
            "tokens": tokens,
            "steps": o.steps,
            "tokens_per_step": o.tokens_per_step,
            "seq_len": o.seq_len,
            "batch_size": o.batch_size,
            "objective": o.objective,
            "precision": precision,
            "warmup_steps": o.warmup_steps,
            "warmup_steps_run": o.warmup_run,
            "eval_tokens": o.eval_tokens,
            "calib_tokens": o.calib_tokens,
            "refine_steps": o.refine_steps,
            "refine_lr": refined.refine_lr,
            "refine_qk_lr": refined.refine_qk_lr,
            "refine_target": refined.refine_target,
            "refine_schedule": refined.refine_schedule,
            "refine_loss": refined.refine_loss_used,
            "seed": o.seed,
            "data": o.data and str(o.data),
        },  # fmt: skip
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
                "resumed": c.resumed,
            }
            for c in curves
        },
        "reference": ref,
        "best_rates": {
            start: {f"{t:g}": {"lr": lr, **r.as_dict()} for t, (r, lr) in by_t.items()}
            for start, by_t in best.items()
        },
        "savings": {s: {f"{t:g}": v.as_dict() for t, v in by_t.items()} for s, by_t in saved.items()},
        "elapsed_s": round(elapsed_s, 1),
        "machine": machine,
        "versions": versions,
    }
    results_json = out / "results.json"
    _write(results_json, json.dumps(results, indent=2) + "\n")
    return report, results_json, plot


__all__ = ["PLOT", "plot_curves", "write_report"]
