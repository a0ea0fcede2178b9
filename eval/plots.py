"""The PNG plots of ``gqakit eval``: decode tokens/s and KV-cache MiB against context, perplexity bars; only
the finite figures (:func:`non_finite` lists the others for the report), each model named as in the table.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gqakit.eval.decode import DecodePoint
    from gqakit.eval.results import EvalResults

MIB = 1024**2
PLOTS = {"decode": "decode_tokens_per_s.png", "kv": "kv_cache_mib.png", "quality": "perplexity.png"}
LOG_SPAN = 10  # max / min of the values from which an axis is logarithmic
_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]
_LINES = ["-", "--", ":", "-."]
# a plot's lines: (model label, batch) -> (context, value) points
Lines = dict[tuple[str, int], list[tuple[int, float | None]]]


def figure(*grid: int, figsize: tuple[float, float], **kwargs: Any):
    """A matplotlib figure and its axes (``kwargs``: :meth:`Figure.subplots`'), without pyplot (no backend,
    no global state to close); the pipelines' reports draw theirs with it too."""
    logging.getLogger("matplotlib").setLevel(logging.ERROR)  # no font-cache chatter on the terminal
    # deferred: matplotlib takes a second to import
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=120)
    return fig, fig.subplots(*grid, **kwargs)


def log_axis(ax, values: Sequence[float | None], label: str, axis: str = "y") -> bool:
    """Label ``axis`` of ``ax``, on a log scale (the label says so) when the finite positive ``values`` span
    :data:`LOG_SPAN` times or more (a 12.9 beside a 17,395 is a flat line on a linear axis); return
    whether it is."""
    shown = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    wide = len(shown) > 1 and max(shown) / min(shown) >= LOG_SPAN
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log" if wide else "linear")
    (ax.set_ylabel if axis == "y" else ax.set_xlabel)(label + (" (log scale)" if wide else ""))
    return wide


def non_finite(results: EvalResults) -> list[str]:
    """The figures that are not finite (``"MQA's perplexity (nan)"``), which the plots leave out."""
    out = []
    for m in results.models.values():
        for attr, name in (("ppl", "perplexity"), ("bits_per_byte", "bits per byte")):
            value = getattr(m.perplexity, attr) if m.perplexity else 0.0
            if not math.isfinite(value):
                out.append(f"{m.label}'s {name} ({value})")
    return out


def write_plots(results: EvalResults, out: Path) -> list[Path]:
    """The PNGs this run has data for: decode tokens/s and KV MiB against context (``--bench``), perplexity
    bars (the KV cache per token without ``--bench`` is the report's table's)."""
    models, written = list(results.models.values()), []
    if any(m.decode for m in models):
        tokens_per_s = _by_batch(results, lambda p: p.tokens_per_s if p.status == "ok" else None)
        title = "Decode tokens/s (higher is better)"
        written.append(_grid_plot(results, out / PLOTS["decode"], tokens_per_s, "decode tokens/s", title))
        measured = all(p.kv_bytes is not None for m in models for p in m.decode if p.status == "ok")
        # vLLM's paged cache and llama.cpp give the prediction only; an OOM point has no measurement either:
        # the prediction is drawn there
        kv_mib = _by_batch(results, lambda p: (p.kv_bytes or p.kv_bytes_predicted) / MIB)
        source = "measured on the cache" if measured else "measured, else predicted"
        title = "KV-cache size after decoding (lower is better)"
        written.append(_grid_plot(results, out / PLOTS["kv"], kv_mib, f"KV cache MiB ({source})", title))
    quality = _quality_plot(results, out / PLOTS["quality"])
    return written + ([quality] if quality else [])


def _by_batch(results: EvalResults, value: Callable[[DecodePoint], float | None]) -> Lines:
    """Each (model, batch)'s ``value`` against context over the decode grid."""
    by_context = operator.attrgetter("context")
    return {
        (m.label, b): [(p.context, value(p)) for p in sorted(m.decode, key=by_context) if p.batch == b]
        for m in results.models.values()
        for b in sorted({p.batch for p in m.decode})
    }


def _subtitle(results: EvalResults) -> str:
    """What the figures ran on: the device and the dtypes."""
    dtypes = ", ".join(sorted({m.dtype for m in results.models.values()}))
    return f"{results.environment['device_name']} · {dtypes}"


def _save(fig, path: Path, ax=None) -> Path:
    """The legend of ``ax`` outside the axes (the labels are long), then write the PNG."""
    if ax is not None and ax.get_legend_handles_labels()[0]:  # every point out of memory: no line
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    return path


def _value_axis(ax, values: Sequence[float], label: str) -> None:
    """The y axis of ``values``: log where they span ten times or more (``label`` says so), else from 0."""
    if not log_axis(ax, values, label):
        ax.set_ylim(bottom=0, top=max([v for v in values if math.isfinite(v)], default=1) * 1.15)
    ax.grid(True, which="major", axis="y", alpha=0.3)


def _colors(results: EvalResults) -> dict[str, str]:
    return {label: f"C{i % 10}" for i, label in enumerate(results.models)}  # matplotlib's tab10 cycle


def _grid_plot(results: EvalResults, path: Path, lines: Lines, ylabel: str, title: str) -> Path:
    """A line per (model, batch) of its values against context (finite values only)."""
    color = _colors(results)
    batches = sorted({b for _, b in lines})
    fig, ax = figure(figsize=(8, 5))
    shown: list[float] = []
    for (label, b), pts in lines.items():
        pts = [(c, v) for c, v in pts if v is not None and math.isfinite(v)]
        if not pts:
            continue
        shown += [v for _, v in pts]
        j = batches.index(b)
        ax.plot(
            *zip(*pts, strict=True), color=color[label], linestyle=_LINES[j % len(_LINES)],
            marker=_MARKERS[j % len(_MARKERS)], linewidth=2, markersize=6,
            label=label if len(batches) == 1 else f"{label}, batch {b}",
        )  # fmt: skip
    contexts = sorted({c for pts in lines.values() for c, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.grid(True, which="major", axis="x", alpha=0.3)
    _value_axis(ax, shown, ylabel)
    ax.set_title(f"{title}\n{_subtitle(results)}", fontsize=10)
    return _save(fig, path, ax)


def _quality_plot(results: EvalResults, path: Path) -> Path | None:
    """Perplexity and bits per byte bars of the models whose figures are finite; None when none is."""
    models = [m for m in results.models.values() if m.perplexity and math.isfinite(m.perplexity.ppl)]
    if not models:
        return None
    color = _colors(results)
    fig, axes = figure(1, 2, figsize=(max(8, 1.6 * len(models) + 4), 4.5))
    long_names = len(models) > 4 or max(len(m.label) for m in models) > 10
    for ax, attr, name in [(axes[0], "ppl", "perplexity"), (axes[1], "bits_per_byte", "bits per byte")]:
        values = [getattr(m.perplexity, attr) for m in models]
        bars = ax.bar(range(len(models)), values, color=[color[m.label] for m in models])
        ax.bar_label(
            bars, labels=[f"{v:.3f}" if v < 100 else f"{v:,.0f}" for v in values], fontsize=8, padding=2
        )
        # the table's names, slanted where they would run into each other
        ax.set_xticks(
            range(len(models)), [m.label for m in models], fontsize=8, rotation=30 if long_names else 0,
            ha="right" if long_names else "center",
        )  # fmt: skip
        _value_axis(ax, values, f"{name} (lower is better)")
    p = models[0].perplexity
    fig.suptitle(
        f"{results.options.ppl_data}: {p.tokens:,} tokens, seq_len {p.seq_len}, stride {p.stride}\n"
        f"{_subtitle(results)}",
        fontsize=10,
    )
    return _save(fig, path)
