"""The PNG plots of ``gqakit eval``: decode tokens/s and KV-cache MiB against context, perplexity bars.

Each plot draws only what :class:`~gqakit.eval.results.EvalResults` holds data for; the file names are
in :data:`PLOTS`, and :func:`gqakit.eval.report.write_report` links them from report.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gqakit.eval.options import DEFAULT_CONTEXTS

if TYPE_CHECKING:
    from gqakit.eval.results import EvalResults, ModelResult

MIB = 1024**2
PLOTS = {"decode": "decode_tokens_per_s.png", "kv": "kv_cache_mib.png", "quality": "perplexity.png"}


def write_plots(results: EvalResults, out: Path) -> list[Path]:
    """The PNGs this run has data for: decode tokens/s and KV MiB against context, perplexity bars."""
    # deferred: matplotlib takes a second to import
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
    # deferred: matplotlib takes a second to import
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
    # deferred: matplotlib takes a second to import
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
    # deferred: matplotlib takes a second to import
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
    # deferred: matplotlib takes a second to import
    import matplotlib.pyplot as plt

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
    # deferred: matplotlib takes a second to import
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
    measured = all(p.kv_bytes is not None for m in models for p in m.decode if p.status == "ok")
    # vLLM's paged cache (and a llama.cpp build whose log gqakit cannot read) give the prediction only
    ax.set_ylabel(
        "KV cache MiB (measured on the cache object)"
        if measured
        else "KV cache MiB (measured where the engine reports it, else predicted)"
    )
    ax.set_title(f"KV-cache size after decoding (lower is better)\n{_subtitle(results)}", fontsize=11)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    return _save(fig, ax, path)


def _quality_plot(results: EvalResults, path: Path) -> Path:
    # deferred: matplotlib takes a second to import
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


__all__ = ["MIB", "PLOTS", "write_plots"]
