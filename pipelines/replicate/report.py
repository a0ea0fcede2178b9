"""The report of ``gqakit replicate``: what the paper claims, what this run measured, and whether each
claim reproduced; ``report.md``, ``results.json`` and figures drawn like the paper's."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gqakit import __version__
from gqakit.convert.methods import PAPER_METHODS
from gqakit.pipelines.replicate.options import ReplicateOptions
from gqakit.pipelines.reporting import (
    kv_label,
    log_if_wide,
    md_table,
    pyplot,
    save_figure,
    wall_time,
    write_report,
)
from gqakit.storage import make_dirs

# Ainslie et al. 2023, Table 1 (T5, mean over the paper's summarization, translation and QA tasks; time
# per sample on TPUv4): the paper's own figures, quoted beside ours.
PAPER_TABLE_1 = [
    ("MHA-Large", 0.37, 46.0),
    ("MHA-XXL", 1.51, 47.2),
    ("MQA-XXL (uptrained, alpha 0.05)", 0.24, 46.6),
    ("GQA-8-XXL (uptrained, alpha 0.05)", 0.28, 47.1),
]
PAPER_CLAIMS = {
    "fig4": "Mean pooling is the best start, then the first head, then random initialisation (Fig. 4).",
    "fig5": "Uptraining recovers most of the quality with a small proportion alpha of the pretraining "
    "steps; returns level off between alpha = 0.05 and 0.1 (Fig. 5).",
    "fig6": "GQA with a few groups is close to MHA in quality and close to MQA in speed (Fig. 6, Table 1).",
    "scratch": "Uptrained MQA/GQA beat a model of the same kind trained from scratch on the same budget "
    "(the paper's uptraining rationale; its MHA-Large row is the same-speed comparison).",
}


def _ppl(arms, **where) -> list[float]:
    return [a.ppl for a in arms if all(getattr(a, k) == v for k, v in where.items()) and a.ppl is not None]


def findings(o: ReplicateOptions, arms, decode: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Each claim of the paper against this run's numbers: the numbers, and whether it reproduced."""
    top = max(o.alphas)
    mha = (_ppl(arms, kind="mha-continued") or _ppl(arms, kind="mha"))[0]  # as many tokens as the arms
    out: dict[str, Any] = {"mha_ppl": _ppl(arms, kind="mha")[0], "mha_continued_ppl": mha}
    methods = [m for m in PAPER_METHODS if m in o.starts]
    at0 = {m: _ppl(arms, kind="converted", groups=1, method=m, alpha=0.0)[0] for m in methods}
    mid = {m: _ppl(arms, kind="converted", groups=1, method=m, alpha=o.middle_alpha) for m in at0}
    mid_mean = {m: statistics.mean(v) for m, v in mid.items() if v}
    out["fig4"] = {
        "alpha_0": at0,
        "alpha_mid": {m: {"mean": statistics.mean(v), "runs": v} for m, v in mid.items() if v},
        "ordered_at_0": _in_paper_order(at0),
        "ordered_after": _in_paper_order(mid_mean),
    }
    # The conversion alone (alpha 0) is one arm whatever the seeds (run._arm_plan makes it with seed 0);
    # an uptrained point is the first seed's run.
    curves = {m: {a: _ppl(arms, kind="converted", groups=1, method=m, alpha=a,
                          **({"seed": o.seeds[0]} if a > 0 else {}))[0]
                  for a in o.alphas} for m in o.starts}  # fmt: skip
    mean = [curves["mean"][a] for a in o.alphas] if "mean" in curves else []
    gains = [a - b for a, b in zip(mean, mean[1:], strict=False)]
    out["fig5"] = {
        "curves": curves,
        "mean_gains": gains,
        # two gains to compare, or it is not measured (None), not "not reproduced"
        "levels_off": gains[-1] < gains[0] if len(gains) > 1 else None,
    }
    gqa = {g: _ppl(arms, kind="converted", groups=g, method="mean", alpha=top)[0] for g in o.groups}
    mqa = gqa.get(1)
    gaps = {g: (p - mha) / (mqa - mha) if mqa and mqa != mha else None for g, p in gqa.items()}
    out["fig6"] = {"ppl": gqa, "share_of_mha_mqa_gap": gaps, "decode": decode}
    scratch = {a.groups: a.ppl for a in arms if a.kind == "scratch"}
    uptrained = {**gqa, o.model.heads: mha}  # MHA's "uptrained" counterpart: the continued MHA model
    out["scratch"] = {g: {"scratch": p, "uptrained": uptrained.get(g)} for g, p in scratch.items()}
    out["scratch_reproduced"] = all(v["uptrained"] is not None and v["uptrained"] < v["scratch"]
                                    for g, v in out["scratch"].items() if g != o.model.heads)  # fmt: skip
    return out


def write_replicate_report(
    o: ReplicateOptions, arms, decode, elapsed_s: float, reused: int, compute_s: float
) -> tuple[Path, Path, list[Path]]:
    """Write ``report.md``, ``results.json`` and the figures into ``o.out``; return their paths.

    Args:
        o: the run's options.
        arms: every model of the report.
        decode: decode time per G.
        elapsed_s: this run's wall time.
        reused: results it reused from the working directory.
        compute_s: what the results shown took to compute, whichever run computed them.
    """
    out = Path(o.out).resolve()
    make_dirs(out)
    f = findings(o, arms, decode)
    figures = [save_figure(fig, out / name) for name, fig in replicate_figures(o, f).items()]
    results = {
        "gqakit": __version__,
        "options": _options_json(o),
        "pretrain_tokens": o.pretrain_tokens,
        "arms": [asdict(a) for a in arms],
        "findings": f,
        "elapsed_s": round(elapsed_s, 1),
        "compute_s": round(compute_s, 1),
    }
    took = wall_time(elapsed_s, reused, compute_s)
    report, results_json = write_report(out, _markdown(o, f, took, figures), results)
    return report, results_json, figures


def _options_json(o: ReplicateOptions) -> dict[str, Any]:
    d = {k: v for k, v in asdict(o).items() if k not in ("echo", "corpus")}
    return json.loads(json.dumps(d, default=str))


def _in_paper_order(ppl: dict[str, float]) -> bool | None:
    """Whether the paper's methods in ``ppl`` rank as in Fig. 4 (mean, first, random; lower perplexity
    first); None (not measured) with fewer than two of them, where any order would agree."""
    if len(ppl) < 2:
        return None
    return sorted(ppl, key=ppl.get) == [m for m in PAPER_METHODS if m in ppl]


def _yes(ok: bool | None) -> str:
    """A finding's verdict: None is a claim this run's options did not measure."""
    if ok is None:
        return "not measured with these options"
    return "reproduced" if ok else "**not reproduced** at this scale"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return md_table(header, rows).splitlines()


def _markdown(o: ReplicateOptions, f, took: str, figures: list[Path]) -> str:
    m, top, mid = o.model, max(o.alphas), o.middle_alpha
    f4, f5, f6 = f["fig4"], f["fig5"], f["fig6"]
    intro = (
        f"A Llama-architecture model ({m.layers} layers, hidden {m.hidden}, {m.heads} query and {m.heads} "
        f"K/V heads, vocabulary {m.vocab:,}: byte-level BPE on the train split) pretrained from random "
        f"initialisation on {o.pretrain_tokens:,} tokens of wiki-en ({o.steps} steps, LM objective). Test "
        f"perplexity on the first {o.eval_tokens:,} test tokens in {m.seq_len}-token windows. MHA: "
        f"**{f['mha_ppl']:.2f}**; MHA trained on as many more tokens as the largest alpha: "
        f"**{f['mha_continued_ppl']:.2f}** (the reference of the uptrained arms). Took "
        f"{took}."
    )
    lines = ["# gqakit replicate: the GQA paper's experiments on an MHA model trained here", "", intro, ""]
    lines += ["## Fig. 4: which start", "", f"Paper: {PAPER_CLAIMS['fig4']}", ""]
    rows = []
    for meth, p0 in f4["alpha_0"].items():
        after = f4["alpha_mid"].get(meth, {})
        runs = ", ".join(f"{r:.2f}" for r in after.get("runs", []))
        rows.append([meth, f"{p0:,.2f}", f"{after.get('mean', float('nan')):,.2f} ({runs})"])
    lines += _table(["method", "MQA, no uptraining", f"MQA, alpha {mid:g}: mean over seeds (each)"], rows)
    lines += ["", f"mean < first < random (lower is better): with no uptraining {_yes(f4['ordered_at_0'])}; "
              f"after uptraining {_yes(f4['ordered_after'])}"
              + (" (an order needs two of mean, first and random in --starts)." if None in
                 (f4["ordered_at_0"], f4["ordered_after"]) else "."), ""]  # fmt: skip
    lines += ["## Fig. 5: how much uptraining", "", f"Paper: {PAPER_CLAIMS['fig5']}", ""]
    rows = [[meth] + [f"{c[a]:,.2f}" for a in o.alphas] for meth, c in f5["curves"].items()]
    lines += _table(["MQA from", *(f"alpha {a:g}" for a in o.alphas)], rows)
    gains = ", ".join(f"{g:,.2f}" for g in f5["mean_gains"])
    lines += ["", f"Gains of mean pooling from one alpha to the next: {gains}; levelling off "
              f"{_yes(f5['levels_off'])}.", ""]  # fmt: skip
    lines += [_recovered(o, f), ""] if "mean" in f5["curves"] else []
    lines += [_start_against_mean(o, f5["curves"], meth) for meth in ("calibrated", "fast", "best")
              if meth in f5["curves"] and "mean" in f5["curves"]]  # fmt: skip
    lines += [""]
    lines += ["## Fig. 6 / Table 1: how many groups", "", f"Paper: {PAPER_CLAIMS['fig6']}", "",
              f"Mean pooling uptrained at alpha {top:g}. Decode: transformers, batch 8, on this machine; at "
              "this model size a decode step is bound by per-step overhead rather than bytes moved, so the "
              "KV column is what G buys here (llama.cpp on a real model: docs/llamacpp.md).", ""]  # fmt: skip
    rows = [[f"MHA ({m.heads} K/V heads), as many tokens", f"{f['mha_continued_ppl']:,.2f}", "0%"]]
    for g in sorted(f6["ppl"], reverse=True):
        share = f6["share_of_mha_mqa_gap"][g]
        rows.append([kv_label(g, m.heads), f"{f6['ppl'][g]:,.2f}",
                     f"{100 * share:.0f}%" if share is not None else "-"])  # fmt: skip
    for row, g in zip(rows, [m.heads, *sorted(f6["ppl"], reverse=True)], strict=True):
        d = f6["decode"].get(g, {})
        ms = f"{d['ms_per_token']:.2f}" if d.get("ms_per_token") else "-"
        row += [
            ms + ("" if d.get("reliable", True) else " (unreliable)"),
            f"{d.get('kv_bytes_per_token', 0):,}",
        ]
    lines += _table(
        ["model", "perplexity", "share of the MHA-MQA gap", "decode ms/token", "KV bytes/token"], rows
    )
    lines += ["", "The paper's Table 1 (its numbers: T5 on TPUv4, average score of its tasks):", ""]
    lines += _table(["model", "time per sample (s)", "average score"],
                    [[n, f"{t}", f"{sc}"] for n, t, sc in PAPER_TABLE_1])  # fmt: skip
    lines += ["", "## Uptrained against trained from scratch", "", f"Paper: {PAPER_CLAIMS['scratch']}", ""]
    rows = [[f"{g} (MHA; continued, not converted)" if g == m.heads else f"{g}", f"{v['scratch']:,.2f}",
             f"{v['uptrained']:,.2f}" if v["uptrained"] else "-"]
            for g, v in sorted(f["scratch"].items())]  # fmt: skip
    lines += _table(
        ["K/V heads", "from scratch, same total tokens", f"uptrained from MHA, alpha {top:g}"], rows
    )
    total = o.pretrain_tokens + o.uptrain_steps(top) * o.tokens_per_step
    lines += ["", f"Uptrained better than from scratch: {_yes(f['scratch_reproduced'])}. The from-scratch "
              f"models train {total:,} tokens in one schedule; the MHA model scores {f['mha_ppl']:,.2f} "
              f"after its {o.pretrain_tokens:,} pretraining tokens. The MHA row separates what the tokens in "
              "one schedule buy from what the number of K/V heads costs.", "",
              "## Figures", "", *(f"![{p.stem}]({p.name})" for p in figures), "",
              f"Every number: `results.json`. gqakit {__version__}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _recovered(o: ReplicateOptions, f) -> str:
    """How much of mean pooling's gap to the MHA reference each alpha closes."""
    curve, ref = f["fig5"]["curves"]["mean"], f["mha_continued_ppl"]
    start = curve[o.alphas[0]]
    parts = [f"{100 * (start - curve[a]) / (start - ref):.0f}% at alpha {a:g}" for a in o.alphas[1:]]
    return (
        f"Mean pooling closes {', '.join(parts)} of its gap to the MHA reference "
        f"({start:,.2f} -> {ref:,.2f})."
        if parts and start != ref
        else ""
    )


def _start_against_mean(o: ReplicateOptions, curves, meth: str) -> str:
    """Where a start with no uptraining stands against the mean-pooled arms."""
    p0 = curves[meth][o.alphas[0]]
    reached = [a for a in o.alphas if curves["mean"][a] <= p0]
    where = (
        f"mean pooling needs alpha {reached[0]:g} to reach it"
        if reached
        else (f"better than mean pooling at every alpha up to {max(o.alphas):g}")
    )
    best = min(curves[meth], key=curves[meth].get)
    p_best = curves[meth][best]
    return f"- {meth}, no uptraining: {p0:,.2f} ({where}); its best: {p_best:,.2f} at alpha {best:g}."


def replicate_figures(o: ReplicateOptions, f) -> dict[str, Any]:
    """The figures by file name: ``quality_vs_alpha.png`` (cf. the paper's Fig. 5) and ``groups.png``
    (Fig. 6); perplexities spanning ten times or more on a log axis."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    values = [f["mha_ppl"], f["mha_continued_ppl"]]
    for meth, curve in f["fig5"]["curves"].items():
        ax.plot(list(curve), list(curve.values()), marker="o", label=f"MQA from {meth}")
        values += list(curve.values())
    ax.axhline(f["mha_ppl"], color="black", linestyle="--", label="MHA")
    ax.axhline(f["mha_continued_ppl"], color="black", linestyle="-.", label="MHA, + the largest alpha")
    colors = ("#7f7f7f", "#bcbd22", "#17becf")
    for i, (g, v) in enumerate(sorted(f["scratch"].items())):
        name = kv_label(g, o.model.heads)
        ax.axhline(
            v["scratch"], color=colors[i % 3], linestyle=":", label=f"{name} from scratch, same total tokens"
        )
        values.append(v["scratch"])
    log = log_if_wide(ax, values)
    ax.set_xlabel("uptraining proportion alpha (of the pretraining tokens)")
    ax.set_ylabel("test perplexity" + (" (log scale)" if log else "") + ", lower is better")
    ax.set_title("Quality against uptraining (cf. the paper's Fig. 5)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    figures = {"quality_vs_alpha.png": fig}

    f6, heads = f["fig6"], o.model.heads
    gs = sorted([heads, *f6["ppl"]])
    ppl = [f["mha_continued_ppl"] if g == heads else f6["ppl"][g] for g in gs]
    ms = [f6["decode"].get(g, {}).get("ms_per_token") or float("nan") for g in gs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    axes[0].plot(gs, ppl, marker="o")
    log = log_if_wide(axes[0], ppl)
    axes[0].set_ylabel(
        f"test perplexity (uptrained at alpha {max(o.alphas):g})" + (", log scale" if log else "")
    )
    axes[1].plot(gs, ms, marker="o", color="#c44e52")
    axes[1].set_ylabel("decode ms per token (batch 8)")
    axes[1].set_ylim(bottom=0)  # differences of a few percent are this machine's noise, not G
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(gs, [str(g) for g in gs])
        ax.set_xlabel("K/V heads G (G = H is MHA, 1 is MQA)")
    fig.suptitle("Quality and decode time against the number of groups (cf. the paper's Fig. 6)")
    fig.tight_layout()
    figures["groups.png"] = fig
    return figures
