"""The demo's report: the table, ``report.md``, ``results.json`` and the plots."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gqakit import __version__
from gqakit.dtypes import short_name
from gqakit.eval.decode import DECODE_TOLERANCE, speedup
from gqakit.pipelines.demo.options import KV_TOKENS
from gqakit.pipelines.reporting import (
    command_line,
    fmt_duration,
    fmt_ppl,
    log_if_wide,
    md_table,
    pyplot,
    save_figure,
    wall_time,
    write_report,
)
from gqakit.storage import make_dirs

if TYPE_CHECKING:
    from gqakit.pipelines.demo.measure import ModelEval


def _speed(stats) -> str:
    """A median with ± half the range of its rounds."""
    if stats is None or stats.median is None:
        return "OOM" if stats is not None else "-"
    return f"{stats.median:,.1f} ±{50 * (stats.spread or 0):.0f}%"


def render_table(rows: list[ModelEval], batch: int, context: int, dtype: str) -> str:
    """The demo's Markdown table; speedups are relative to the first row (the MHA baseline). The llama.cpp
    and vLLM columns appear when they were measured."""
    base, lbase, vbase = rows[0].decode_stats, rows[0].llamacpp_stats, rows[0].vllm_stats
    llama = any(r.llamacpp_stats is not None for r in rows)
    vllm = any(r.vllm_stats is not None for r in rows)
    header = [
        "model",
        "K/V heads",
        "perplexity",
        "bits/byte",
        f"KV cache, {KV_TOKENS} tokens (MiB, {short_name(dtype)})",
    ]
    header += [f"decode tokens/s (batch {batch}, context {context})", "decode speedup"]
    if llama:
        header += [f"llama.cpp tokens/s (f16, batch 1, context {context})", "llama.cpp speedup"]
    if vllm:
        header += [f"vLLM tokens/s (batch {batch}, context {context})", "vLLM speedup"]
        header += ["vLLM KV capacity in 1 GiB (tokens)"]
    lines = []
    for r in rows:
        tps = r.decode_tokens_per_s
        cell = _speed(r.decode_stats) if r.decode_stats else (f"{tps:,.1f}" if tps else "OOM")
        ratio = speedup(r.decode_stats, base) if r.decode_stats else "-"
        line = [
            r.label,
            r.kv_heads,
            fmt_ppl(r.ppl),
            f"{r.bits_per_byte:.3f}",
            f"{r.kv_mib:,.1f}",
            cell,
            ratio,
        ]
        if llama:
            line += [_speed(r.llamacpp_stats), speedup(r.llamacpp_stats, lbase)]
        if vllm:
            kv = f"{r.vllm_kv_tokens:,}" if r.vllm_kv_tokens else "-"
            line += [_speed(r.vllm_stats), speedup(r.vllm_stats, vbase), kv]
        lines.append(line)
    return md_table(header, lines)


def _read_metrics(path: str) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def demo_figures(rows: list[ModelEval], uptrained: dict[str, dict[str, Any]], dtype: str) -> dict[str, Any]:
    """The demo's figures by file name, each model named as the table names it: ``quality.png``
    (perplexity and bits per byte), ``kv_decode.png`` (KV cache and decode speed) and ``uptraining.png``
    (validation perplexity during uptraining, when the runs logged it). Bars run horizontally, so the
    long labels read on the y axis and never overlap; a quantity spanning ten times or more is drawn on a
    log axis."""
    plt = pyplot()
    colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd"]
    colors = (colors * (len(rows) // len(colors) + 1))[: len(rows)]
    y = list(range(len(rows)))[::-1]  # the first row on top, as in the table
    figures = {}

    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 2), sharey=True)
    for ax, values, what, fmt in (
        (axes[0], [r.ppl for r in rows], "test perplexity", fmt_ppl),
        (axes[1], [r.bits_per_byte for r in rows], "bits per byte", lambda v: f"{v:.3f}"),
    ):
        ax.barh(y, values, color=colors)
        log = log_if_wide(ax, values, "x")
        ax.set_xlabel(what + (" (log scale)" if log else ""))
        for yy, v in zip(y, values, strict=True):
            ax.annotate(fmt(v), (v, yy), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set_xlim(right=max(values) * (3 if log else 1.2))
    axes[0].set_yticks(y, [r.label for r in rows], fontsize=8)
    fig.suptitle("Quality on the test split: lower is better")
    fig.tight_layout()
    figures["quality.png"] = fig

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ctx = [2**k for k in range(7, 14)]
    seen: set[int] = set()
    for r, c in zip(rows, colors, strict=True):
        if r.kv_heads in seen:
            continue
        seen.add(r.kv_heads)
        per_token = r.kv_mib / KV_TOKENS
        axes[0].plot(ctx, [per_token * n for n in ctx], marker="o", color=c, label=f"G = {r.kv_heads}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("tokens in the cache (one sequence)")
    axes[0].set_ylabel(f"KV cache (MiB, {short_name(dtype)}, log scale)")
    axes[0].legend()
    _decode_bars(axes[1], rows, colors)
    fig.suptitle("KV cache size and decode speed by the number of K/V heads G")
    fig.tight_layout()
    figures["kv_decode.png"] = fig

    curves = {u.get("label", slug): _read_metrics(u.get("metrics", "")) for slug, u in uptrained.items()}
    curves = {label: [m for m in ms if "val_ppl" in m] for label, ms in curves.items()}
    if any(curves.values()):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        values = []
        for label, ms in curves.items():
            if ms:
                x = [m.get("tokens", m.get("step", i)) for i, m in enumerate(ms)]
                ax.plot(x, [m["val_ppl"] for m in ms], marker="o", label=label)
                values += [m["val_ppl"] for m in ms]
        log = log_if_wide(ax, values)
        ax.set_xlabel("training tokens")
        ax.set_ylabel("validation perplexity" + (" (log scale)" if log else ""))
        ax.legend()
        ax.set_title("Validation perplexity during uptraining: lower is better")
        fig.tight_layout()
        figures["uptraining.png"] = fig
    return figures


def write_demo_plots(
    out: Path, rows: list[ModelEval], uptrained: dict[str, dict[str, Any]], dtype: str
) -> list[Path]:
    """Write :func:`demo_figures` into ``out``; their paths."""
    return [save_figure(fig, out / name) for name, fig in demo_figures(rows, uptrained, dtype).items()]


def _decode_bars(ax, rows: list[ModelEval], colors: list[str]) -> None:
    """Decode tokens/s as horizontal bars (the long labels read on the y axis, never overlapping): each
    bar the median round, its whisker the range of the rounds, and a bar whose rounds disagree hatched and
    marked "unreliable", as the table marks it."""
    y = list(range(len(rows)))[::-1]  # the first row on top, as in the table
    tps = [r.decode_tokens_per_s or 0.0 for r in rows]
    lo = [
        max(0.0, t - min(x for x in r.decode_stats.rounds if x)) if _ran(r) else 0.0
        for r, t in zip(rows, tps, strict=True)
    ]
    hi = [
        max(x for x in r.decode_stats.rounds if x) - t if _ran(r) else 0.0
        for r, t in zip(rows, tps, strict=True)
    ]
    bars = ax.barh(y, tps, color=colors, xerr=[lo, hi], capsize=3)
    for bar, r, t, yy, h in zip(bars, rows, tps, y, hi, strict=True):
        unreliable = r.decode_stats is not None and not r.decode_stats.reliable
        if unreliable:
            bar.set_hatch("//")
            bar.set_alpha(0.5)
        text = "OOM" if not t else f"{t:,.0f}" + (" unreliable" if unreliable else "")
        ax.annotate(text, (t + h, yy), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(y, [r.label for r in rows], fontsize=7)
    d = rows[0].result.decode[0]
    ax.set_xlabel(f"decode tokens/s (batch {d.batch}, context {d.context}), whiskers: the rounds")
    ax.set_xlim(right=max([t + h for t, h in zip(tps, hi, strict=True)] + [1.0]) * 1.35)


def _ran(r: ModelEval) -> bool:
    return r.decode_stats is not None and any(r.decode_stats.rounds)


def _uptrain_line(slug: str, u: dict[str, Any]) -> str:
    val = ""
    if u.get("final_val_ppl") is not None:
        before = u.get("initial_val_ppl")
        val = (
            f", validation perplexity {fmt_ppl(before)} -> "
            if before is not None
            else ", validation perplexity "
        )
        val += fmt_ppl(u["final_val_ppl"])
    took = f" in {fmt_duration(u['elapsed_s'])}" if u.get("elapsed_s") else ""
    return (
        f"- `{slug}`: {u['steps']} steps, {u['tokens']:,} tokens{took}, objective `{u['objective']}`{val}; "
        f"model in `{u['output_dir']}`"
    )


def write_demo_report(
    out: Path,
    original: ModelEval,
    rows: list[ModelEval],
    checks: dict[str, float],
    uptrained: dict[str, dict[str, Any]],
    settings: dict[str, Any],
    elapsed_s: float,
) -> tuple[Path, Path, list[Path]]:
    """Write ``report.md``, ``results.json`` and the plots into ``out``; return their paths."""
    make_dirs(out)
    plots = write_demo_plots(out, rows, uptrained, settings["dtype"])
    command = command_line("gqakit demo")
    table = render_table(rows, settings["decode_batch"], settings["decode_context"], settings["dtype"])
    tokens = f"{original.tokens:,} tokens" + (
        " (capped)" if settings["eval_tokens"] else " (the whole split)"
    )
    check_lines = "\n".join(
        f"- {name}: max |logit difference| = {diff:.3g}" + (" (identical)" if diff == 0 else "")
        for name, diff in checks.items()
    )
    up_lines = "\n".join(_uptrain_line(slug, u) for slug, u in uptrained.items())
    images = "\n".join(f"![{p.stem}]({p.name})" for p in plots)
    took = wall_time(elapsed_s, settings["reused"], settings["compute_s"])
    text = f"""# gqakit demo

`{command}` on {settings["device"]} ({settings["dtype"]}): {took}.
Source model `{settings["source"]}`; test text `{settings["test"]}`.

{table}

- Perplexity and bits per byte: {tokens} of the test split, {settings["seq_len"]}-token windows.
- KV cache: one sequence of {KV_TOKENS} tokens, every layer, keys and values.
- Decode: median per-token latency of {settings["new_tokens"]} greedy decoding steps with a
  {settings["decode_context"]}-token cache, batch {settings["decode_batch"]}; every model loaded once and
  measured in {settings["decode_rounds"]} short interleaved rounds (rotated order), the median round
  shown with ± half the range of the rounds. A speedup (relative to the first row) is printed only when
  both models' rounds agree within {100 * DECODE_TOLERANCE:.0f}% of their median; otherwise
  "unreliable": the machine's load changed during the measurement.
- The {original.label}: perplexity {fmt_ppl(original.ppl)},
  {original.bits_per_byte:.3f} bits/byte, decode {original.decode_tokens_per_s or 0:,.1f} tokens/s.

## Exactness checks

{check_lines}

## Uptraining

{up_lines}

## Plots

{images}

Machine-readable figures: `results.json`. gqakit {__version__}, torch {torch.__version__},
Python {platform.python_version()}, {platform.machine()}.
"""
    results = {
        "gqakit": __version__,
        "torch": torch.__version__,
        "command": command,
        "elapsed_s": round(elapsed_s, 1),
        "settings": settings,
        "original": original.summary(),
        "rows": [r.summary() for r in rows],
        "checks": checks,
        "uptrain": uptrained,
        "plots": [p.name for p in plots],
    }
    report, results_json = write_report(out, text, results)
    return report, results_json, plots
