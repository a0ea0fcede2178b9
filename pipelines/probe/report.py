"""What ``gqakit probe`` measured (one row per combination) and its output: ``probe.json``, ``probe.md``
(the table) and ``probe.png``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gqakit.convert.methods import METHODS
from gqakit.eval.plots import figure, log_axis
from gqakit.eval.report import md_table
from gqakit.geometry import TP_DEGREES, AttentionGeometry, TensorParallelKV
from gqakit.storage import make_dirs, write_json, write_text

ERROR_FLOOR = 1e-6  # the plot's lower limit: exact merges give 0 (or float noise)


@dataclass
class ProbeRow:
    """One measured combination (G = None: the original)."""

    groups: int | None
    method: str
    ppl: float
    ppl_ratio: float
    attn_error: list[float] = field(default_factory=list)
    key_error: float | None = None
    value_error: float | None = None
    seconds: float = 0.0

    @property
    def mean_attn_error(self) -> float | None:
        return sum(self.attn_error) / len(self.attn_error) if self.attn_error else None


@dataclass
class ProbeResult:
    """Every measured row of a probe of ``source``, whose attention is ``geom``."""

    source: str
    geom: AttentionGeometry
    rows: list[ProbeRow]
    settings: dict[str, Any]

    def to_table(self) -> str:
        def f(x: float | None) -> str:
            return "" if x is None else f"{x:.4f}"

        header = ["G", "method", "perplexity", "x original", "attn-out error (mean)"]
        rows = []
        for r in self.rows:
            g = "orig" if r.groups is None else r.groups
            errors = [f(r.mean_attn_error), f(r.key_error), f(r.value_error)]
            rows.append([g, r.method, f"{r.ppl:,.2f}", f"{r.ppl_ratio:,.2f}", *errors])
        return md_table([*header, "key err", "value err"], rows)

    def tensor_parallel(self) -> dict[int, list[TensorParallelKV]]:
        """For the original's G and each G probed: the KV cache per GPU under tensor parallelism
        (:meth:`~gqakit.geometry.AttentionGeometry.tensor_parallel_kv`), as ``gqakit inspect`` shows it."""
        gs = dict.fromkeys([self.geom.num_kv_heads, *sorted(self.settings["groups"], reverse=True)])
        return {g: replace(self.geom, num_kv_heads=g).tensor_parallel_kv() for g in gs}

    def tensor_parallel_table(self) -> str:
        """KV bytes per GPU per token (bf16) at each TP degree, one row per G; a replicated head (G < TP:
        vLLM copies each K/V head to TP / G GPUs) and a degree transformers' own TP refuses are marked."""

        def cell(t: TensorParallelKV) -> str:
            marks = ["replicated"] if t.replicated else []
            marks += ["transformers refuses"] if t.transformers_refuses else []
            return f"{t.kv_bytes_per_gpu:,}" + (f" ({', '.join(marks)})" if marks else "")

        rows = [
            [f"{g}" + (" (original)" if g == self.geom.num_kv_heads else ""), *map(cell, tps)]
            for g, tps in self.tensor_parallel().items()
        ]
        return md_table(["K/V heads G", *(f"TP={tp}" for tp in TP_DEGREES)], rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "num_heads": self.geom.num_heads,
            "num_kv_heads": self.geom.num_kv_heads,
            "settings": self.settings,
            "rows": [{**asdict(r), "mean_attn_error": r.mean_attn_error} for r in self.rows],
            "tensor_parallel": {g: [asdict(t) for t in tps] for g, tps in self.tensor_parallel().items()},
        }


def write_probe(result: ProbeResult, out_dir: Path) -> None:
    """``probe.json``, ``probe.md`` and ``probe.png`` in ``out_dir``."""
    geom, s = result.geom, result.settings
    text = f"""# gqakit probe: {result.source}

{geom.num_heads} query heads, {geom.num_kv_heads} K/V heads; perplexity on {s["eval_tokens"]} held-out tokens
in {s["seq_len"]}-token windows; attention-output error on {s["error_tokens"]} tokens.

{result.to_table()}

## KV cache per GPU under tensor parallelism

Bytes per token over all layers, bf16, on each of TP GPUs. With fewer K/V heads than GPUs (G < TP) each GPU
still holds one whole head (replicated), so the cache per GPU stops shrinking; transformers' own tensor
parallelism refuses a degree that does not divide both head counts.

{result.tensor_parallel_table()}
"""
    make_dirs(out_dir)
    write_json(out_dir / "probe.json", json.loads(json.dumps(result.to_json(), default=str)))
    write_text(out_dir / "probe.md", text)
    probe_figure(result).savefig(out_dir / "probe.png", dpi=110)


def probe_figure(result: ProbeResult) -> Any:
    """Zero-shot perplexity per combination (a log axis when they span ten times or more) and the
    per-layer attention-output errors (always log)."""
    rows = [r for r in result.rows if r.groups is not None]
    colors = {m: f"C{i % 10}" for i, m in enumerate(METHODS)}
    styles = ["-", "--", ":", "-."]
    g_values = sorted({r.groups for r in rows})
    fig, (ax1, ax2) = figure(1, 2, figsize=(13, 5))
    labels = [f"G={r.groups} {r.method}" for r in rows]
    bars = ax1.bar(range(len(rows)), [r.ppl for r in rows], color=[colors[r.method] for r in rows])
    ax1.bar_label(bars, [f"{r.ppl:,.0f}" if r.ppl >= 100 else f"{r.ppl:.1f}" for r in rows], fontsize=7)
    ax1.axhline(result.rows[0].ppl, color="black", ls="--", lw=1, label=f"original {result.rows[0].ppl:.1f}")
    log_axis(ax1, [r.ppl for r in rows] + [result.rows[0].ppl], "held-out perplexity")
    ax1.set_xticks(range(len(rows)), labels, fontsize=8, rotation=45, ha="right")
    ax1.set_title("zero-shot perplexity")
    ax1.legend(fontsize=8)
    for r, label in zip(rows, labels, strict=True):
        floored = [max(e, ERROR_FLOOR) for e in r.attn_error]  # exact merges (0) stay on a log axis
        ls = styles[g_values.index(r.groups) % len(styles)]
        ax2.plot(floored, color=colors[r.method], ls=ls, marker=".", label=label)
    ax2.set_yscale("log")
    ax2.set_xlabel("layer")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_ylabel(f"relative attention-output error (floor {ERROR_FLOOR:g})")
    ax2.set_title("per-layer attention-output reconstruction error")
    ax2.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(
        f"gqakit probe: {Path(result.source).name}, {result.geom.num_heads} query heads, "
        f"{result.geom.num_kv_heads} K/V heads",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
