"""Several ``gqakit recovery`` runs of the same source and data at different learning rates, read together:
every (start, learning rate) curve's tokens to each threshold, then, per start and threshold, the rate
that got there in the fewest tokens, and the savings over the reference start's best rate.

A recovery run compares starts at the rates it was given (``--lr``, ``--start-lr``). Which rate is best
differs by start and by threshold: a rate that reaches 1.2x early can level off above 1.05x. The
savings a practitioner budgets by compare each start at its own best measured rate. One run of ``gqakit
recovery --start-lr START=LR,LR,...`` measures and reports them itself; this reads them off runs made
apart (e.g. one device call each) that differ only in ``--start-lr``::

    G=benchmarks/results/gpu-h100
    python benchmarks/recovery_lr_sweep.py $G/smollm2-mqa-5m{,-lr-sweep-a,-lr-sweep-b} \\
        --out $G/smollm2-mqa-5m-lr-sweep.md

Each argument is a ``--out`` folder of ``gqakit recovery`` (its ``results.json``). The runs must share
the original's perplexity (the same source, held-out text and precision) and the tokens per step; the
first run's reference start (mean pooling by default) is the reference here too. The table is printed
with this command line, and written with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from gqakit.errors import GqakitError
from gqakit.pipelines.recovery.curves import THRESHOLDS, best_rates, saving, tokens_to_reach


def load_runs(folders: list[Path]) -> tuple[float, str, dict[tuple[str, float], list[tuple[float, float]]]]:
    """The original's perplexity, the reference start, and every (start, lr) curve as (tokens, ratio).

    Raises:
        GqakitError: a folder without results.json, runs whose original or tokens per step differ, or
            one (start, lr) in two folders.
    """
    original, reference, step = None, None, None
    curves: dict[tuple[str, float], list[tuple[float, float]]] = {}
    for folder in folders:
        path = folder / "results.json"
        if not path.is_file():
            raise GqakitError(f"{folder} holds no results.json; give gqakit recovery --out folders.")
        try:
            r = json.loads(path.read_text())
            ppl, per_step = float(r["original_ppl"]), int(r["settings"]["tokens_per_step"])
            # keyed by start, or by "start @ lr" in a run that swept the start's rates itself
            runs = {
                (s.get("start", name), float(s["lr"])): [
                    (float(p["tokens"]), float(p["ppl"]) / ppl) for p in s["points"]
                ]
                for name, s in r["starts"].items()
            }
            first = r["reference"]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise GqakitError(
                f"{path} is not a gqakit recovery results.json ({type(e).__name__}: {e})."
            ) from None
        if original is None:
            original, reference, step = ppl, first, per_step
        elif not math.isclose(ppl, original, rel_tol=1e-6) or per_step != step:
            raise GqakitError(
                f"{folder} measured the original at {ppl:.4f} with {per_step:,} tokens a step, the first run "
                f"{original:.4f} with {step:,}: these runs are not comparable (same source, held-out text, "
                "precision and batch needed)."
            )
        for key, points in runs.items():
            if key in curves:  # keeping the better of two would pick a run by its result
                raise GqakitError(
                    f"{folder} measures {key[0]} at lr {key[1]:g} again; give each start and rate once."
                )
            curves[key] = points
    assert original is not None and reference is not None
    return original, reference, curves


def table(original: float, reference: str, curves: dict[tuple[str, float], list[tuple[float, float]]]) -> str:
    """The sweep as markdown: every curve, then each start at its best rate per threshold."""
    heads = " | ".join(f"{t:g}x" for t in THRESHOLDS)
    rule = "|---|---:|---:|---:|" + "---:|" * len(THRESHOLDS)
    lines = [
        f"Original: {original:.3f}. Tokens to reach each multiple of it (interpolated in log tokens).",
        "",
        f"| start | lr | at 0 tokens | at the end | {heads} |",
        rule,
    ]
    order = sorted(curves, key=lambda k: (k[0] != reference, k[0], k[1]))
    for start, lr in order:
        pts = curves[(start, lr)]
        reaches = " | ".join(tokens_to_reach(pts, t).label() for t in THRESHOLDS)
        end = f"{pts[-1][1]:.3f}x at {pts[-1][0]:,.0f}"
        lines.append(f"| {start} | {lr:g} | {pts[0][1]:,.3f}x | {end} | {reaches} |")
    best = best_rates({k: {t: tokens_to_reach(p, t) for t in THRESHOLDS} for k, p in curves.items()})
    ref = best[reference]
    lines += [
        "",
        f"Each start at its best measured rate per threshold (the rate in brackets), and how many times "
        f"fewer tokens than {reference} at its best rate it needs (a lower bound, >=, where {reference} "
        "never got there).",
        "",
        f"| start | {heads} |",
        "|---|" + "---:|" * len(THRESHOLDS),
    ]
    for start in sorted(best, key=lambda s: (s != reference, s)):
        cells = []
        for t in THRESHOLDS:
            reach, lr = best[start][t]
            # a start already there needs no rate; one never there has no best rate
            cell = f"{reach.label()} ({lr:g})" if reach.reached and reach.tokens > 0 else reach.label()
            if start != reference:
                cell += f"; {saving(reach, ref[t][0]).label()}"
            cells.append(cell)
        lines.append(f"| {start} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="gqakit recovery --out folders")
    ap.add_argument("--out", type=Path, help="write the table (markdown) here too")
    args = ap.parse_args()
    try:
        original, reference, curves = load_runs(args.runs)
    except GqakitError as e:
        sys.exit(f"Error: {e}")
    text = f"`python {shlex.join(sys.argv)}`\n\n" + table(original, reference, curves)
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
