"""``report.md``, ``results.json`` and PNG plots from :class:`~gqakit.eval.api.EvalResults`.

report.md opens with one table: a row per model, the baseline first, every other row with its delta
against the baseline (perplexity, bits per byte, lm-eval metrics, KV cache per token, decode
tokens/s at the largest measured point with its speedup and the bytes-moved bound). The full decode
grid and the lm-eval metrics follow. results.json holds every figure, the options, versions, device,
dtype and the command line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gqakit.eval.api import EvalResults, ModelResult

MIB = 1024**2
PLOTS = {"decode": "decode_tokens_per_s.png", "kv": "kv_cache_mib.png", "quality": "perplexity.png"}


def write_report(results: EvalResults, out_dir: str | Path) -> Path:
    """Write report.md, results.json and the plots into ``out_dir`` (created); return report.md's path."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    data = results.to_dict()
    plots = write_plots(results, out)
    data["plots"] = sorted(p.name for p in plots)
    (out / "results.json").write_text(json.dumps(_finite(data), indent=2, default=str) + "\n")
    report = out / "report.md"
    report.write_text(render_markdown(results, [p.name for p in plots]))
    return report


def _finite(obj: Any) -> Any:
    """JSON has no inf/nan: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------- markdown
def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{digits}f}"


def _signed(x: float | None, digits: int = 3, suffix: str = "") -> str:
    return "–" if x is None else f"{x:+.{digits}f}{suffix}"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < MIB else f"{n / MIB:.2f} MiB"


def headline_point(results: EvalResults) -> tuple[int, int] | None:
    """The (batch, context) shown in the headline table: the largest one every model measured."""
    sets = [{(p.batch, p.context) for p in m.decode if p.status == "ok"} for m in results.models.values()]
    common = set.intersection(*sets) if sets and all(sets) else set()
    return max(common, key=lambda bc: (bc[0] * bc[1], bc[1])) if common else None


# The metric of a task shown in the headline table, in order of preference; the rest go below it.
_PREFERRED = ("acc_norm", "acc", "exact_match", "bits_per_byte", "f1", "mc2", "word_perplexity")


def headline_metrics(results: EvalResults) -> list[str]:
    """One ``task/metric`` per lm-eval task for the headline table."""
    by_task: dict[str, list[str]] = {}
    for k in sorted({k for m in results.models.values() for k in m.task_metrics()}):
        by_task.setdefault(k.split("/")[0], []).append(k.split("/", 1)[1])
    out = []
    for task, names in by_task.items():
        best = next((n for n in _PREFERRED if n in names), names[0])
        out.append(f"{task}/{best}")
    return out


def _table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> str:
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(results: EvalResults, plots: list[str]) -> str:
    """The text of report.md."""
    env, opts = results.environment, results.options
    comps = results.comparisons()
    base = results.models.get(results.baseline) if results.baseline else None
    metrics = headline_metrics(results)
    point = headline_point(results)

    header = ["model", "KV heads (G/H)", "KV cache / token"]
    if opts.ppl_data:
        header += ["perplexity", "Δ ppl", "bits/byte", "Δ bits/byte"]
    for k in metrics:
        header += [k, "Δ"]
    if point:
        header += [f"decode tok/s (b={point[0]}, ctx={point[1]})", "speedup", "bound (bytes moved)"]
    rows = []
    for m in results.models.values():
        c = comps.get(m.label, {})
        is_base = base is not None and m.label == base.label
        name = f"**{m.label}** (baseline)" if is_base else m.label
        row = [name, f"{m.num_kv_heads}/{m.num_heads}", _kib(m.kv_bytes_per_token)]
        if opts.ppl_data:
            p = m.perplexity
            row += [
                _fmt(p.ppl, 4) if p else "–",
                ""
                if is_base or not c
                else f"{_signed(c.get('ppl_delta'), 3)} ({_signed(c.get('ppl_delta_pct'), 1, '%')})",
                f"{p.bits_per_byte:.4f}" if p else "–",
                "" if is_base or not c else _signed(c.get("bits_per_byte_delta"), 4),
            ]
        tm = m.task_metrics()
        for k in metrics:
            d = c.get("task_deltas", {}).get(k)
            row += [f"{tm[k]:.4f}" if k in tm else "–", "" if is_base or d is None else _signed(d, 4)]
        if point:
            pt = m.point(*point)
            dec = next((d for d in c.get("decode", []) if (d["batch"], d["context"]) == point), None)
            row += [_fmt(pt.tokens_per_s, 1) if pt else "–"]
            if is_base or dec is None:
                row += ["1.00×" if is_base else "–", "1.00×" if is_base else "–"]
            else:
                row += [f"{dec['speedup']:.2f}×", f"{dec['bound']:.2f}×"]
        rows.append(row)

    dtypes = ", ".join(sorted({m.dtype for m in results.models.values()}))
    parts = [
        "# gqakit eval report",
        "",
        f"Device: {env['device']} ({env['device_name']}); dtype: {dtypes}; "
        f"gqakit {env['versions']['gqakit']}, "
        f"torch {env['versions']['torch']}, transformers {env['versions']['transformers']}, "
        f"lm-eval {env['versions']['lm_eval']}.",
        "",
        f"Command: `{env['command_line']}`",
        "",
        _table(header, rows, ["---"] + ["---:"] * (len(header) - 1)),
        "",
    ]
    notes = []
    if opts.ppl_data:
        p0 = next((m.perplexity for m in results.models.values() if m.perplexity), None)
        if p0:
            notes.append(
                f"Perplexity: `{opts.ppl_data}`, {p0.tokens:,} tokens / {p0.bytes:,} bytes, "
                f"seq_len {p0.seq_len}, stride {p0.stride}. Perplexity compares models with one tokenizer; "
                "bits per byte compares any."
            )
        toks = {m.perplexity.tokens for m in results.models.values() if m.perplexity}
        if len(toks) > 1:
            notes.append("The models tokenize the text differently: compare bits per byte, not perplexity.")
    if point:
        notes.append(
            "Speedup: decode tokens/s over the baseline's. Bound: the baseline's bytes moved per decode step "
            "over the model's (weights read once + the KV cache), the speedup memory traffic allows."
        )
    parts += [f"- {n}" for n in notes] + ([""] if notes else [])

    if any(m.decode for m in results.models.values()):
        parts += ["## Decode grid", "", _decode_table(results, comps), ""]
    if metrics:
        parts += ["## lm-eval", "", _lm_eval_table(results), ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(parts)


def _decode_table(results: EvalResults, comps: dict[str, Any]) -> str:
    header = [
        "model",
        "batch",
        "context",
        "prefill s",
        "decode ms/token",
        "tokens/s",
        "KV MiB (measured)",
        "KV MiB (predicted)",
        "speedup",
        "bound",
        "% of bound",
    ]
    rows = []
    for m in results.models.values():
        dec = {(d["batch"], d["context"]): d for d in comps.get(m.label, {}).get("decode", [])}
        for p in m.decode:
            d = dec.get((p.batch, p.context))
            if p.status != "ok":
                rows.append(
                    [
                        m.label,
                        str(p.batch),
                        str(p.context),
                        "OOM",
                        "OOM",
                        "OOM",
                        "–",
                        f"{p.kv_bytes_predicted / MIB:.1f}",
                        "–",
                        "–",
                        "–",
                    ]
                )
                continue
            rows.append(
                [
                    m.label,
                    str(p.batch),
                    str(p.context),
                    f"{p.prefill_s:.3f}",
                    f"{p.decode_ms:.2f}",
                    f"{p.tokens_per_s:.1f}",
                    f"{p.kv_bytes / MIB:.1f}",
                    f"{p.kv_bytes_predicted / MIB:.1f}",
                    f"{d['speedup']:.2f}×" if d and d["speedup"] else "–",
                    f"{d['bound']:.2f}×" if d else "–",
                    f"{100 * d['of_bound']:.0f}%" if d and d["of_bound"] else "–",
                ]
            )
    return _table(header, rows, ["---", "---:", "---:"] + ["---:"] * 8)


def _lm_eval_table(results: EvalResults) -> str:
    labels = list(results.models)
    metrics = sorted({k for m in results.models.values() for k in m.task_metrics()})
    rows = []
    for k in metrics:
        row = [k]
        for label in labels:
            v = results.models[label].task_metrics().get(k)
            row.append("–" if v is None else f"{v:.4f}")
        rows.append(row)
    return _table(["task/metric", *labels], rows)


# -------------------------------------------------------------------------------------------- plots
def write_plots(results: EvalResults, out: Path) -> list[Path]:
    """The PNGs this run has data for: decode tokens/s and KV MiB against context, perplexity bars."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    models = list(results.models.values())
    if any(m.decode for m in models):
        written.append(
            _line_plot(
                results,
                out / PLOTS["decode"],
                "tokens_per_s",
                "decode tokens/s",
                "Decode throughput (higher is better)",
            )
        )
    written.append(_kv_plot(results, out / PLOTS["kv"]))
    if any(m.perplexity for m in models):
        written.append(_quality_plot(results, out / PLOTS["quality"]))
    return written


def _styles(models: list[ModelResult]):
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    return {m.label: colors[i % len(colors)] for i, m in enumerate(models)}


_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]
_LINES = ["-", "--", ":", "-."]


def _subtitle(results: EvalResults) -> str:
    dtypes = ", ".join(sorted({m.dtype for m in results.models.values()}))
    return f"{results.environment['device_name']} · {dtypes}"


def _save(fig, ax, path: Path) -> Path:
    """Legend outside the axes (the labels are long), then write the PNG and free the figure."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _context_axis(ax, contexts: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts)
    ax.set_xticklabels([str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.grid(True, which="major", alpha=0.3)


def _line_plot(results: EvalResults, path: Path, attr: str, ylabel: str, title: str) -> Path:
    import matplotlib.pyplot as plt

    models = list(results.models.values())
    color = _styles(models)
    batches = sorted({p.batch for m in models for p in m.decode})
    contexts = sorted({p.context for m in models for p in m.decode})
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for m in models:
        for j, b in enumerate(batches):
            pts = sorted((p for p in m.decode if p.batch == b and p.status == "ok"), key=lambda p: p.context)
            if not pts:
                continue
            ax.plot(
                [p.context for p in pts],
                [getattr(p, attr) for p in pts],
                color=color[m.label],
                linestyle=_LINES[j % len(_LINES)],
                marker=_MARKERS[j % len(_MARKERS)],
                linewidth=2,
                markersize=6,
                label=f"{m.label} (G={m.num_kv_heads}), batch {b}",
            )
            ooms = [p.context for p in m.decode if p.batch == b and p.status != "ok"]
            for c in ooms:
                ax.annotate("OOM", (c, pts[-1].__dict__[attr]), color=color[m.label], fontsize=8)
    _context_axis(ax, contexts)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title}\n{_subtitle(results)}", fontsize=11)
    return _save(fig, ax, path)


def _kv_plot(results: EvalResults, path: Path) -> Path:
    """KV MiB against context: measured per (model, batch) when the decode grid ran, else the formula
    at batch 1 over the default contexts."""
    import matplotlib.pyplot as plt

    from gqakit.eval.api import DEFAULT_CONTEXTS

    models = list(results.models.values())
    if any(m.decode for m in models):
        return _kv_measured(results, path)
    color = _styles(models)
    contexts = list(DEFAULT_CONTEXTS)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for m in models:
        ax.plot(
            contexts,
            [m.kv_bytes_per_token * c / MIB for c in contexts],
            color=color[m.label],
            marker="o",
            linewidth=2,
            label=f"{m.label} (G={m.num_kv_heads})",
        )
    _context_axis(ax, contexts)
    ax.set_ylabel("KV cache MiB per sequence (predicted)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"KV-cache size, batch 1 (lower is better)\n{_subtitle(results)}", fontsize=11)
    return _save(fig, ax, path)


def _kv_measured(results: EvalResults, path: Path) -> Path:
    import matplotlib.pyplot as plt

    models = list(results.models.values())
    color = _styles(models)
    batches = sorted({p.batch for m in models for p in m.decode})
    contexts = sorted({p.context for m in models for p in m.decode})
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for m in models:
        for j, b in enumerate(batches):
            pts = sorted((p for p in m.decode if p.batch == b), key=lambda p: p.context)
            if not pts:
                continue
            # OOM points have no measurement: draw the prediction there, hollow.
            ys = [(p.kv_bytes if p.kv_bytes is not None else p.kv_bytes_predicted) / MIB for p in pts]
            ax.plot(
                [p.context for p in pts],
                ys,
                color=color[m.label],
                linestyle=_LINES[j % len(_LINES)],
                marker=_MARKERS[j % len(_MARKERS)],
                linewidth=2,
                markersize=6,
                label=f"{m.label} (G={m.num_kv_heads}), batch {b}",
            )
    _context_axis(ax, contexts)
    ax.set_yscale("log")
    ax.set_ylabel("KV cache MiB (measured on the cache object)")
    ax.set_title(f"KV-cache size after decoding (lower is better)\n{_subtitle(results)}", fontsize=11)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    return _save(fig, ax, path)


def _quality_plot(results: EvalResults, path: Path) -> Path:
    import matplotlib.pyplot as plt

    models = [m for m in results.models.values() if m.perplexity]
    color = _styles(list(results.models.values()))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(models) + 4), 4.5), dpi=120)
    for ax, attr, title in [(axes[0], "ppl", "perplexity"), (axes[1], "bits_per_byte", "bits per byte")]:
        values = [getattr(m.perplexity, attr) for m in models]
        bars = ax.bar(range(len(models)), values, color=[color[m.label] for m in models])
        ax.bar_label(
            bars, labels=[f"{v:.3f}" if v < 100 else f"{v:,.1f}" for v in values], fontsize=8, padding=2
        )
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels([f"{m.label}\nG={m.num_kv_heads}" for m in models], fontsize=8)
        ax.set_title(f"{title} (lower is better)", fontsize=10)
        ax.set_ylim(0, max(values) * 1.15)
        ax.grid(True, axis="y", alpha=0.3)
    p = models[0].perplexity
    fig.suptitle(
        f"{results.options.ppl_data}: {p.tokens:,} tokens, seq_len {p.seq_len}, stride {p.stride}\n"
        f"{_subtitle(results)}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path
