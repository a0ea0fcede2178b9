"""``report.md``, ``results.json`` and PNG plots from :class:`~gqakit.eval.results.EvalResults`.

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

from gqakit.eval.plots import MIB, PLOTS, write_plots
from gqakit.eval.serving import serving_table

if TYPE_CHECKING:
    from gqakit.eval.results import EvalResults


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
        heads = f"{m.num_kv_heads}/{m.num_heads}" + (
            f" (cache: {m.cached_kv_heads})" if m.cached_kv_heads else ""
        )
        row = [name, heads, _kib(m.kv_bytes_per_token)]
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
                row += [_speedup(dec), f"{dec['bound']:.2f}×"]
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
    if any(m.cached_kv_heads for m in results.models.values()):
        notes.append(
            "KV heads: the weights' K/V heads / query heads; \"cache: N\" where this engine's KV cache "
            "holds N heads per layer instead (transformers broadcasts Falcon-40B/180B's K/V heads to every "
            "query head before caching them; vLLM and llama.cpp cache the weights' heads). KV cache / token "
            "counts the heads the cache holds."
        )
    if point:
        notes.append(
            "Speedup: decode tokens/s over the baseline's. Bound: the baseline's bytes moved per decode step "
            "over the model's (weights read once + the KV cache), the speedup memory traffic allows."
        )
    parts += [f"- {n}" for n in notes] + ([""] if notes else [])

    serving = [m for m in results.models.values() if m.serving]
    if serving:
        s = serving[0].serving
        budget = f"{s.kv_budget_bytes / 2**30:g} GiB of KV memory" if s.kv_budget_bytes else "its GPU share"
        parts += [
            "## Serving",
            "",
            f"{s.engine}: the KV cache it allocated for {budget}, the sequences of {s.context:,} tokens "
            f"it holds at once (whole blocks of {s.block_size}), and greedy continuations of fixed prompts "
            "against transformers'. Capacity ratio: the model's tokens over the baseline's; bound: the "
            "baseline's KV bytes per token over the model's (H/G).",
            "",
            serving_table(serving, results.baseline),
            "",
        ]
    if any(m.decode for m in results.models.values()):
        parts += ["## Decode grid", "", _decode_table(results, comps), ""]
        if any(p.rounds for m in results.models.values() for p in m.decode):
            parts += [
                "Each point: the median of its rounds (tokens/s ± spread, (max - min) / median); a speedup "
                'needs both points\' rounds within the tolerance, else it reads "unreliable". Batch: '
                "concurrent sequences; tokens/s: output tokens per second over them.",
                "",
            ]
    if metrics:
        parts += ["## lm-eval", "", _lm_eval_table(results), ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(parts)


def _speedup(d: dict[str, Any] | None) -> str:
    """A speedup cell: the ratio, "unreliable" when the rounds disagree, or a dash."""
    if d is None:
        return "–"
    if not d.get("reliable", True):
        return "unreliable"
    return f"{d['speedup']:.2f}×" if d["speedup"] else "–"


def _tokens_per_s(p) -> str:
    text = f"{p.tokens_per_s:.1f}"
    return text if p.spread is None else f"{text} ±{100 * p.spread:.0f}%"


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
                    f"{p.prefill_s:.3f}" if p.prefill_s is not None else "–",  # None: a random-filled cache
                    f"{p.decode_ms:.2f}",
                    _tokens_per_s(p),
                    f"{p.kv_bytes / MIB:.1f}" if p.kv_bytes is not None else "–",  # None: not measured
                    f"{p.kv_bytes_predicted / MIB:.1f}",
                    _speedup(d),
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


__all__ = ["PLOTS", "headline_metrics", "headline_point", "render_markdown", "write_plots", "write_report"]
