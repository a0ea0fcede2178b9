"""The report of ``gqakit replicate``: what the paper claims, what this run measured, and whether each
claim reproduced; ``report.md``, ``results.json`` and figures drawn like the paper's."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gqakit.convert.methods import PAPER_METHODS
from gqakit.eval.plots import figure, log_axis
from gqakit.eval.report import md_table
from gqakit.pipelines.replicate.options import EVAL_TOKENS, ReplicateOptions
from gqakit.pipelines.steps import kv_label, wall_time, write_report
from gqakit.pipelines.store import ResultStore

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
    o: ReplicateOptions, arms, decode, elapsed_s: float, store: ResultStore
) -> tuple[Path, Path, list[Path]]:
    """Write ``report.md``, ``results.json`` and the figures of ``arms`` (every model of the report) and
    ``decode`` (decode time per G) into ``o.out``; return their paths. The wall time states this run's
    ``elapsed_s``, and what the results shown took to compute (``store``), whichever run computed them."""
    f = findings(o, arms, decode)
    compute_s = store.compute_time()
    figures = replicate_figures(o, f)
    results = {
        "options": {k: v for k, v in asdict(o).items() if k not in ("echo", "corpus")},
        "pretrain_tokens": o.pretrain_tokens,
        "arms": [asdict(a) for a in arms],
        "findings": f,
        "elapsed_s": round(elapsed_s, 1),
        "compute_s": round(compute_s, 1),
    }
    took = wall_time(elapsed_s, store.reused, compute_s)
    return write_report(Path(o.out).resolve(), _markdown(o, f, took, list(figures)), results, figures)


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


def _markdown(o: ReplicateOptions, f, took: str, figures: list[str]) -> str:
    m, top, mid = o.model, max(o.alphas), o.middle_alpha
    f4, f5, f6 = f["fig4"], f["fig5"], f["fig6"]
    intro = (
        f"An MHA model ({m.heads} heads; its shape and every setting: results.json) pretrained here on "
        f"{o.pretrain_tokens:,} tokens; test perplexity on the first {EVAL_TOKENS:,} test tokens. MHA: "
        f"**{f['mha_ppl']:.2f}**; MHA trained on as many more tokens as the largest alpha: "
        f"**{f['mha_continued_ppl']:.2f}** (the reference of the uptrained arms). Took {took}."
    )
    lines = ["# gqakit replicate: the GQA paper's experiments on an MHA model trained here", "", intro, ""]
    lines += ["## Fig. 4: which start", "", f"Paper: {PAPER_CLAIMS['fig4']}", ""]
    rows = []
    for meth, p0 in f4["alpha_0"].items():
        after = f4["alpha_mid"].get(meth, {})
        runs = ", ".join(f"{r:.2f}" for r in after.get("runs", []))
        rows.append([meth, f"{p0:,.2f}", f"{after.get('mean', float('nan')):,.2f} ({runs})"])
    lines.append(
        md_table(["method", "MQA, no uptraining", f"MQA, alpha {mid:g}: mean over seeds (each)"], rows)
    )
    lines += ["", f"mean < first < random (lower is better): with no uptraining {_yes(f4['ordered_at_0'])}; "
              f"after uptraining {_yes(f4['ordered_after'])}"
              + (" (an order needs two of mean, first and random in --starts)." if None in
                 (f4["ordered_at_0"], f4["ordered_after"]) else "."), ""]  # fmt: skip
    lines += ["## Fig. 5: how much uptraining", "", f"Paper: {PAPER_CLAIMS['fig5']}", ""]
    rows = [[meth] + [f"{c[a]:,.2f}" for a in o.alphas] for meth, c in f5["curves"].items()]
    lines.append(md_table(["MQA from", *(f"alpha {a:g}" for a in o.alphas)], rows))
    gains = ", ".join(f"{g:,.2f}" for g in f5["mean_gains"])
    lines += ["", f"Gains of mean pooling from one alpha to the next: {gains}; levelling off "
              f"{_yes(f5['levels_off'])}.", ""]  # fmt: skip
    lines += ["## Fig. 6 / Table 1: how many groups", "", f"Paper: {PAPER_CLAIMS['fig6']}", "",
              f"Mean pooling uptrained at alpha {top:g}. Decode: transformers, batch 8, on this machine; at "
              "this model size a decode step is bound by per-step overhead rather than bytes moved, so the "
              "KV column is what G buys here (llama.cpp on a real model: docs/llamacpp.md).", ""]  # fmt: skip
    rows = []
    for g in [m.heads, *sorted(f6["ppl"], reverse=True)]:  # MHA first: the model trained as many tokens
        mha, d = g == m.heads, f6["decode"].get(g, {})
        share = 0.0 if mha else f6["share_of_mha_mqa_gap"][g]
        ms = f"{d['ms_per_token']:.2f}" if d.get("ms_per_token") else "-"
        rows.append(
            [
                f"MHA ({m.heads} K/V heads), as many tokens" if mha else kv_label(g, m.heads),
                f"{f['mha_continued_ppl'] if mha else f6['ppl'][g]:,.2f}",
                f"{100 * share:.0f}%" if share is not None else "-",
                ms + ("" if d.get("reliable", True) else " (unreliable)"),
                f"{d.get('kv_bytes_per_token', 0):,}",
            ]
        )
    header = ["model", "perplexity", "share of the MHA-MQA gap", "decode ms/token", "KV bytes/token"]
    lines.append(md_table(header, rows))
    lines += ["", "The paper's Table 1 (its numbers: T5 on TPUv4, average score of its tasks):", ""]
    lines.append(md_table(["model", "time per sample (s)", "average score"],
                    [[n, f"{t}", f"{sc}"] for n, t, sc in PAPER_TABLE_1]))  # fmt: skip
    lines += ["", "## Uptrained against trained from scratch", "", f"Paper: {PAPER_CLAIMS['scratch']}", ""]
    rows = [[f"{g} (MHA; continued, not converted)" if g == m.heads else f"{g}", f"{v['scratch']:,.2f}",
             f"{v['uptrained']:,.2f}" if v["uptrained"] else "-"]
            for g, v in sorted(f["scratch"].items())]  # fmt: skip
    lines.append(
        md_table(["K/V heads", "from scratch, same total tokens", f"uptrained from MHA, alpha {top:g}"], rows)
    )
    total = o.pretrain_tokens + o.uptrain_steps(top) * o.tokens_per_step
    lines += ["", f"Uptrained better than from scratch: {_yes(f['scratch_reproduced'])}. The from-scratch "
              f"models train {total:,} tokens in one schedule; the MHA row separates what the tokens in one "
              "schedule buy from what the number of K/V heads costs.", "",
              "## Figures", "", *(f"![{Path(p).stem}]({p})" for p in figures)]  # fmt: skip
    return "\n".join(lines) + "\n"


def replicate_figures(o: ReplicateOptions, f) -> dict[str, Any]:
    """The figures by file name: ``quality_vs_alpha.png`` (cf. the paper's Fig. 5) and ``groups.png``
    (Fig. 6); perplexities spanning ten times or more on a log axis."""
    fig, ax = figure(figsize=(7, 4.5))
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
    log_axis(ax, values, "test perplexity, lower is better")
    ax.set_xlabel("uptraining proportion alpha (of the pretraining tokens)")
    ax.set_title("Quality against uptraining (cf. the paper's Fig. 5)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    figures = {"quality_vs_alpha.png": fig}

    f6, heads = f["fig6"], o.model.heads
    gs = sorted([heads, *f6["ppl"]])
    ppl = [f["mha_continued_ppl"] if g == heads else f6["ppl"][g] for g in gs]
    ms = [f6["decode"].get(g, {}).get("ms_per_token") or float("nan") for g in gs]
    fig, axes = figure(1, 2, figsize=(11, 4.2))
    axes[0].plot(gs, ppl, marker="o")
    log_axis(axes[0], ppl, f"test perplexity (uptrained at alpha {max(o.alphas):g})")
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
