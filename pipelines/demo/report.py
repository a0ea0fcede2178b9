"""The demo's report: the table, ``report.md``, ``results.json`` and the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit.dtypes import short_name
from gqakit.eval.decode import DECODE_TOLERANCE, speedup
from gqakit.eval.plots import figure, log_axis
from gqakit.eval.report import md_table
from gqakit.pipelines.demo.options import KV_TOKENS
from gqakit.pipelines.steps import command_line, fmt_duration, fmt_ppl, wall_time, write_report

if TYPE_CHECKING:
    from gqakit.pipelines.demo.measure import ModelEval


def _speed(stats) -> str:
    """A median with ± half the range of its rounds."""
    if stats is None or stats.median is None:
        return "OOM" if stats is not None else "-"
    return f"{stats.median:,.1f} ±{50 * (stats.spread or 0):.0f}%"


def render_table(rows: list[ModelEval], batch: int, context: int, dtype: str) -> str:
    """The demo's Markdown table; speedups are relative to the first row (the MHA baseline). The llama.cpp
    columns appear when they were measured."""
    base, lbase = rows[0].decode_stats, rows[0].llamacpp_stats
    llama = any(r.llamacpp_stats is not None for r in rows)
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
    lines = []
    for r in rows:
        line = [r.label, r.result.num_kv_heads, fmt_ppl(r.ppl), f"{r.result.perplexity.bits_per_byte:.3f}"]
        line += [f"{r.kv_mib:,.1f}"]
        line += [_speed(r.decode_stats), speedup(r.decode_stats, base)]
        if llama:
            line += [_speed(r.llamacpp_stats), speedup(r.llamacpp_stats, lbase)]
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
    colors = [f"C{i % 10}" for i in range(len(rows))]
    y = list(range(len(rows)))[::-1]  # the first row on top, as in the table
    figures = {}

    fig, axes = figure(1, 2, figsize=(12, 0.5 * len(rows) + 2), sharey=True)
    for ax, values, what, fmt in (
        (axes[0], [r.ppl for r in rows], "test perplexity", fmt_ppl),
        (axes[1], [r.result.perplexity.bits_per_byte for r in rows], "bits per byte", lambda v: f"{v:.3f}"),
    ):
        ax.bar_label(ax.barh(y, values, color=colors), [fmt(v) for v in values], padding=3, fontsize=8)
        log = log_axis(ax, values, what, "x")
        ax.set_xlim(right=max(values) * (3 if log else 1.2))
    axes[0].set_yticks(y, [r.label for r in rows], fontsize=8)
    fig.suptitle("Quality on the test split: lower is better")
    fig.tight_layout()
    figures["quality.png"] = fig

    fig, axes = figure(1, 2, figsize=(12, 4.2))
    ctx = [2**k for k in range(7, 14)]
    heads = [r.result.num_kv_heads for r in rows]
    for g in dict.fromkeys(heads):  # one line per G, in the colour of its first row
        i = heads.index(g)
        per_token = rows[i].kv_mib / KV_TOKENS
        axes[0].plot(ctx, [per_token * n for n in ctx], marker="o", color=colors[i], label=f"G = {g}")
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
        fig, ax = figure(figsize=(6.5, 4.2))
        values = []
        for label, ms in curves.items():
            if ms:
                x = [m.get("tokens", m.get("step", i)) for i, m in enumerate(ms)]
                ax.plot(x, [m["val_ppl"] for m in ms], marker="o", label=label)
                values += [m["val_ppl"] for m in ms]
        log_axis(ax, values, "validation perplexity")
        ax.set_xlabel("training tokens")
        ax.legend()
        ax.set_title("Validation perplexity during uptraining: lower is better")
        fig.tight_layout()
        figures["uptraining.png"] = fig
    return figures


def _decode_bars(ax, rows: list[ModelEval], colors: list[str]) -> None:
    """Decode tokens/s as horizontal bars (the long labels read on the y axis, never overlapping): each
    bar the median round, its whisker the range of the rounds, and a bar whose rounds disagree hatched and
    marked "unreliable", as the table marks it."""
    y = list(range(len(rows)))[::-1]  # the first row on top, as in the table
    tps = [r.decode_tokens_per_s or 0.0 for r in rows]
    ran = [[x for x in r.decode_stats.rounds if x] if r.decode_stats else [] for r in rows]
    lo = [t - min(xs) if xs else 0.0 for t, xs in zip(tps, ran, strict=True)]
    hi = [max(xs) - t if xs else 0.0 for t, xs in zip(tps, ran, strict=True)]
    bars = ax.barh(y, tps, color=colors, xerr=[lo, hi], capsize=3)
    texts = []
    for bar, r, t in zip(bars, rows, tps, strict=True):
        unreliable = r.decode_stats is not None and not r.decode_stats.reliable
        if unreliable:
            bar.set_hatch("//")
            bar.set_alpha(0.5)
        texts.append("OOM" if not t else f"{t:,.0f}" + (" unreliable" if unreliable else ""))
    ax.bar_label(bars, texts, padding=4, fontsize=8)  # past the whisker
    ax.set_yticks(y, [r.label for r in rows], fontsize=7)
    d = rows[0].result.decode[0]
    ax.set_xlabel(f"decode tokens/s (batch {d.batch}, context {d.context}), whiskers: the rounds")
    ax.set_xlim(right=max([t + h for t, h in zip(tps, hi, strict=True)] + [1.0]) * 1.35)


def _uptrain_line(slug: str, u: dict[str, Any]) -> str:
    ppl = [fmt_ppl(u[k]) for k in ("initial_val_ppl", "final_val_ppl") if u.get(k) is not None]
    val = f", validation perplexity {' -> '.join(ppl)}" if u.get("final_val_ppl") is not None else ""
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
    figures = demo_figures(rows, uptrained, settings["dtype"])
    command = command_line("gqakit demo")
    table = render_table(rows, settings["decode_batch"], settings["decode_context"], settings["dtype"])
    tokens = f"{original.result.perplexity.tokens:,} tokens" + (
        " (capped)" if settings["eval_tokens"] else " (the whole split)"
    )
    check_lines = "\n".join(
        f"- {name}: max |logit difference| = {diff:.3g}" + (" (identical)" if diff == 0 else "")
        for name, diff in checks.items()
    )
    up_lines = "\n".join(_uptrain_line(slug, u) for slug, u in uptrained.items())
    images = "\n".join(f"![{Path(name).stem}]({name})" for name in figures)
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
- The {original.label}: perplexity {fmt_ppl(original.ppl)}, {original.result.perplexity.bits_per_byte:.3f}
  bits/byte, decode {original.decode_tokens_per_s or 0:,.1f} tokens/s.

## Exactness checks

{check_lines}

## Uptraining

{up_lines}

## Plots

{images}
"""
    results = {
        "elapsed_s": round(elapsed_s, 1),
        "settings": settings,
        "original": original.summary(),
        "rows": [r.summary() for r in rows],
        "checks": checks,
        "uptrain": uptrained,
        "plots": list(figures),
    }
    return write_report(out, text, results, figures, command)
