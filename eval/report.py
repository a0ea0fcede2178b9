"""``report.md`` (opening with :func:`headline_table`, which ``gqakit eval`` also prints), ``results.json``
and the PNG plots from :class:`~gqakit.eval.results.EvalResults` (docs/eval.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit.eval.plots import MIB, non_finite, write_plots
from gqakit.storage import write_text

if TYPE_CHECKING:
    from gqakit.eval.results import EvalResults, ModelResult

DASH = "–"


def write_report(results: EvalResults, out_dir: str | Path) -> Path:
    """Write report.md, results.json and the plots into ``out_dir`` (created); return report.md's path."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    data = results.to_dict()
    plots = write_plots(results, out)
    data["plots"] = sorted(p.name for p in plots)
    # JSON has no inf/nan: they are written as null
    finite = json.loads(json.dumps(data, default=str), parse_constant=lambda _: None)
    write_text(out / "results.json", json.dumps(finite, indent=2) + "\n")
    report = out / "report.md"
    write_text(report, render_markdown(results, [p.name for p in plots]))
    return report


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return DASH
    return f"{x:,.0f}" if abs(x) >= 1000 and math.isfinite(x) else f"{x:.{digits}f}"


def _signed(x: float | None, digits: int = 3, suffix: str = "") -> str:
    return DASH if x is None else f"{x:+.{digits}f}{suffix}"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < MIB else f"{n / MIB:.2f} MiB"


def _ratio(x: float | None) -> str:
    return DASH if x is None else f"{x:.2f}×"


def _heads(m: ModelResult) -> str:
    return f"{m.num_kv_heads}/{m.num_heads}" + (f" (cache: {m.cached_kv_heads})" if m.cached_kv_heads else "")


def _speedup(d: dict[str, Any] | None) -> str:
    """A speedup cell: the ratio, "unreliable" when the rounds disagree, or a dash."""
    return DASH if d is None else _ratio(d["speedup"]) if d["reliable"] else "unreliable"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table: the first column left-aligned, the others (figures) right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


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
    return [
        f"{task}/{next((n for n in _PREFERRED if n in names), names[0])}" for task, names in by_task.items()
    ]


def headline_table(results: EvalResults) -> str:
    """The table report.md opens with and ``gqakit eval`` prints: one row per model, the baseline first."""
    comps = results.comparisons()
    metrics, point = headline_metrics(results), headline_point(results)
    ppl = results.options.ppl_data
    header = ["model", "KV heads (G/H)", "KV cache / token"]
    if ppl:
        header += ["perplexity", "Δ ppl", "bits/byte", "Δ bits/byte"]
    header += [column for k in metrics for column in (k, "Δ")]
    if point:
        header += [f"decode tok/s (b={point[0]}, ctx={point[1]})", "speedup", "bound (bytes moved)"]
    rows = []
    for m in results.models.values():
        is_base = m.label == results.baseline
        c = {} if is_base else comps.get(m.label, {})
        row = [f"**{m.label}** (baseline)" if is_base else m.label, _heads(m), _kib(m.kv_bytes_per_token)]
        if ppl:
            p = m.perplexity
            delta = f"{_signed(c.get('ppl_delta'))} ({_signed(c.get('ppl_delta_pct'), 1, '%')})" if c else ""
            row += [_fmt(p.ppl, 4) if p else DASH, delta, f"{p.bits_per_byte:.4f}" if p else DASH]
            row += [_signed(c.get("bits_per_byte_delta"), 4) if c else ""]
        tm = m.task_metrics()
        for k in metrics:
            d = c.get("task_deltas", {}).get(k)
            row += [f"{tm[k]:.4f}" if k in tm else DASH, "" if d is None else _signed(d, 4)]
        if point:
            pt = m.point(*point)
            dec = next((d for d in c.get("decode", []) if (d["batch"], d["context"]) == point), None)
            row += [_fmt(pt.tokens_per_s, 1) if pt else DASH]
            row += ["1.00×", "1.00×"] if is_base else [_speedup(dec), _ratio(dec and dec["bound"])]
        rows.append(row)
    return md_table(header, rows)


def serving_table(results: EvalResults) -> str:
    """Capacity and its ratio to the baseline beside H/G, per model served (its heads and KV bytes per token
    are the headline table's)."""
    models = [m for m in results.models.values() if m.serving]
    base = results.models.get(results.baseline)
    header = ["model", "KV capacity (tokens)", f"sequences of {models[0].serving.context:,}"]
    header += ["capacity ratio", "bound (KV bytes)"]
    rows = []
    for m in models:
        s = m.serving
        ratio = bound = DASH
        if base is not None and base.serving and base.serving.kv_tokens and s.kv_tokens:
            ratio = _ratio(s.kv_tokens / base.serving.kv_tokens)
            bound = _ratio(base.kv_bytes_per_token / m.kv_bytes_per_token)
        rows.append([m.label, _fmt(s.kv_tokens, 0), _fmt(s.max_sequences, 0), ratio, bound])
    return md_table(header, rows)


def decode_table(results: EvalResults) -> str:
    """Every decode point of every model, with its speedup and bound against the baseline's."""
    comps = results.comparisons()
    header = ["model", "batch", "context", "prefill s", "decode ms/token", "tokens/s", "KV MiB (measured)"]
    header += ["KV MiB (predicted)", "speedup", "bound", "% of bound"]
    rows = []
    for m in results.models.values():
        dec = {(d["batch"], d["context"]): d for d in comps.get(m.label, {}).get("decode", [])}
        for p in m.decode:
            row = [m.label, str(p.batch), str(p.context)]
            predicted = f"{p.kv_bytes_predicted / MIB:.1f}"
            if p.status != "ok":
                rows.append(row + ["OOM"] * 3 + [DASH, predicted] + [DASH] * 3)
                continue
            d = dec.get((p.batch, p.context))
            tps = f"{p.tokens_per_s:.1f}" + ("" if p.spread is None else f" ±{100 * p.spread:.0f}%")
            # None: a random-filled cache (no prefill timed), an engine that does not report its cache
            row += [_fmt(p.prefill_s), f"{p.decode_ms:.2f}", tps]
            row += [DASH if p.kv_bytes is None else f"{p.kv_bytes / MIB:.1f}", predicted, _speedup(d)]
            row += [_ratio(d and d["bound"]), f"{100 * d['of_bound']:.0f}%" if d and d["of_bound"] else DASH]
            rows.append(row)
    return md_table(header, rows)


def lm_eval_table(results: EvalResults) -> str:
    """Every numeric lm-eval metric, a column per model."""
    metrics = sorted({k for m in results.models.values() for k in m.task_metrics()})
    cells = {label: m.task_metrics() for label, m in results.models.items()}
    rows = [[k] + [_fmt(cells[label].get(k), 4) for label in results.models] for k in metrics]
    return md_table(["task/metric", *results.models], rows)


def _notes(results: EvalResults) -> list[str]:
    """What the headline table's figures are, under it."""
    opts, models = results.options, list(results.models.values())
    notes = []
    p0 = next((m.perplexity for m in models if m.perplexity), None)
    if p0:
        notes.append(
            f"Perplexity: `{opts.ppl_data}`, {p0.tokens:,} tokens / {p0.bytes:,} bytes, "
            f"seq_len {p0.seq_len}, stride {p0.stride}. Perplexity compares models with one tokenizer; "
            "bits per byte compares any."
        )
        if len({m.perplexity.tokens for m in models if m.perplexity}) > 1:
            notes.append("The models tokenize the text differently: compare bits per byte, not perplexity.")
    notes += [f"Not finite: {what}; the plots leave it out." for what in non_finite(results)]
    if any(m.cached_kv_heads for m in models):
        notes.append(
            'KV heads: the weights\' K/V heads / query heads; "cache: N": the engine caches N per layer, '
            "as KV cache / token does (transformers repeats Falcon-40B/180B's K/V heads for each query head)."
        )
    if headline_point(results):
        notes.append(
            "Speedup: decode tokens/s over the baseline's. Bound: the baseline's bytes moved per decode step "
            "over the model's (weights read once + the KV cache), the speedup memory traffic allows."
        )
    return notes


def render_markdown(results: EvalResults, plots: list[str]) -> str:
    """The text of report.md."""
    env, models = results.environment, list(results.models.values())
    versions = env["versions"]
    dtypes = ", ".join(sorted({m.dtype for m in models}))
    parts = [
        "# gqakit eval report",
        "",
        f"Device: {env['device']} ({env['device_name']}); dtype: {dtypes}; gqakit {versions['gqakit']}, "
        f"torch {versions['torch']}, transformers {versions['transformers']}, lm-eval {versions['lm_eval']}.",
        "",
        f"Command: `{env['command_line']}`",
        "",
        headline_table(results),
        "",
    ]
    notes = _notes(results)
    parts += [f"- {n}" for n in notes] + ([""] if notes else [])

    def section(title: str, *paragraphs: str) -> None:
        parts.extend([f"## {title}", ""] + [line for p in paragraphs for line in (p, "")])

    served = [m.serving for m in models if m.serving]
    if served:
        s = served[0]
        budget = f"{s.kv_budget_bytes / 2**30:g} GiB of KV memory" if s.kv_budget_bytes else "its GPU share"
        about = (
            f"{s.engine}: the KV cache it allocated for {budget} and the sequences of {s.context:,} tokens "
            f"it holds at once (whole blocks of {s.block_size}). Capacity ratio: the model's tokens over the "
            "baseline's; bound: the baseline's KV bytes per token over the model's (H/G)."
        )
        section("Serving", about, serving_table(results))
    if any(m.decode for m in models):
        rounds = (
            "Each point: the median of its rounds (tokens/s ± spread, (max - min) / median); a speedup "
            'needs both points\' rounds within the tolerance, else it reads "unreliable". Batch: '
            "concurrent sequences; tokens/s: output tokens per second over them."
        )
        section(
            "Decode grid",
            decode_table(results),
            *([rounds] if any(p.rounds for m in models for p in m.decode) else []),
        )
    if headline_metrics(results):
        section("lm-eval", lm_eval_table(results))
    if plots:
        section("Plots", *[f"![{p}]({p})" for p in plots])
    return "\n".join(parts)
