"""The probe's output: ``probe.json``, ``probe.md`` (the table) and ``probe.png``."""

from __future__ import annotations

import json
from pathlib import Path

from gqakit.convert.methods import METHODS
from gqakit.pipelines.probe.results import ProbeResult
from gqakit.pipelines.reporting import pyplot, save_figure

ERROR_FLOOR = 1e-6  # the plot's lower limit: exact merges give 0 (or float noise)


def write_probe(result: ProbeResult, out_dir: Path) -> None:
    """``probe.json``, ``probe.md`` and ``probe.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    (out_dir / "probe.md").write_text(
        f"# gqakit probe: {result.source}\n\n{result.num_heads} query heads, "
        f"{result.num_kv_heads} K/V heads; perplexity on {result.settings['eval_tokens']} held-out tokens "
        f"in {result.settings['seq_len']}-token "
        f"windows; attention-output error on {result.settings['error_tokens']} tokens.\n\n"
        f"{result.to_table()}\n"
    )
    _plot(result, out_dir / "probe.png")
    result.out_dir = out_dir


def _plot(result: ProbeResult, path: Path) -> None:
    plt = pyplot()
    rows = [r for r in result.rows if r.groups is not None]
    colors = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:gray", "tab:green"), strict=False))
    styles = ["-", "--", ":", "-."]
    g_values = sorted({r.groups for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    labels = [f"G={r.groups} {r.method}" + (" sim" if r.grouping == "similarity" else "") for r in rows]
    ax1.bar(
        range(len(rows)),
        [r.ppl for r in rows],
        color=[colors.get(r.method, "tab:purple") for r in rows],
        hatch=None,
        edgecolor=["black" if r.grouping == "similarity" else "none" for r in rows],
    )
    ax1.axhline(result.rows[0].ppl, color="black", ls="--", lw=1, label=f"original {result.rows[0].ppl:.1f}")
    values = [r.ppl for r in rows] + [result.rows[0].ppl]
    if max(values) / min(values) > 10:
        ax1.set_yscale("log")
    ax1.set_xticks(range(len(rows)), labels, fontsize=8, rotation=45, ha="right")
    ax1.set_ylabel("held-out perplexity")
    ax1.set_title("zero-shot perplexity (outlined: similarity grouping)")
    ax1.legend(fontsize=8)
    for i, r in enumerate(rows):
        ax1.text(
            i,
            r.ppl,
            f"{r.ppl:,.0f}" if r.ppl >= 100 else f"{r.ppl:.1f}",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    for r, label in zip(rows, labels, strict=True):
        floored = [max(e, ERROR_FLOOR) for e in r.attn_error]  # exact merges (0) stay on a log axis
        ax2.plot(
            range(len(floored)),
            floored,
            color=colors.get(r.method, "tab:purple"),
            ls=styles[g_values.index(r.groups) % len(styles)],
            marker="o" if r.grouping == "similarity" else ".",
            label=label,
        )
    ax2.set_yscale("log")
    ax2.set_xlabel("layer")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_ylabel(f"relative attention-output error (floor {ERROR_FLOOR:g})")
    ax2.set_title("per-layer attention-output reconstruction error")
    ax2.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(
        f"gqakit probe: {Path(result.source).name}, {result.num_heads} query heads, "
        f"{result.num_kv_heads} K/V heads",
        fontsize=10,
    )
    fig.tight_layout()
    save_figure(fig, path)


__all__ = ["ERROR_FLOOR", "write_probe"]
