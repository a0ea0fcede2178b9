"""Two conversions of one checkpoint with the same settings, layer by layer, from their records.

The records are the conversions' ``gqakit.json``. Made for the same calibrated + refined conversion run on
two devices (a CPU and CUDA): the records must agree on every setting (calibration text, tokens,
refinement steps, rates, target, loss, seed), and the per-layer numbers show how far the devices'
arithmetic moves the result: the merge's key/value errors (solved on the original's inputs) and each
layer's held-out error before and after refinement.

    python benchmarks/compare_conversions.py \\
        benchmarks/results/recovery/smollm2-mqa-48k-lcpt-start/gqakit.json \\
        benchmarks/results/gpu-h100/smollm2-mqa-5m/start-refined-gqakit.json --names cpu,cuda \\
        --out benchmarks/results/gpu-h100/layerwise-smollm2-cuda-vs-cpu.md

``--heldout-ppl ORIGINAL MODEL`` also scores MODEL (a directory holding the first record's conversion) and
ORIGINAL on held-out text exactly as a ``gqakit recovery`` run scores its points (``--seq-len`` blocks,
the first ``--eval-tokens``, float32 on this machine's CPU), for a model converted on one device beside a
recovery report measured on another:

    python benchmarks/compare_conversions.py A/gqakit.json B/gqakit.json --names cpu,cuda \
        --heldout-ppl ~/.cache/gqakit/smollm2-135m/model A --heldout ~/.cache/gqakit/wiki-en/test.txt
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# settings that must be equal for the comparison to mean anything (elapsed times and devices may differ)
CALIBRATION_KEYS = ("sha256", "tokens", "seq_len")
REFINE_KEYS = ("steps", "lr", "qk_lr", "seed", "tokens", "heldout_tokens", "target", "schedule", "loss")


def settings_problems(a: dict, b: dict) -> list[str]:
    """The settings on which two records differ (empty when they are the same conversion)."""
    problems = [f"groups: {a['groups']} vs {b['groups']}"] if a["groups"] != b["groups"] else []
    for section, keys in (("calibration", CALIBRATION_KEYS), ("refine", REFINE_KEYS)):
        for k in keys:
            x, y = (a.get(section) or {}).get(k), (b.get(section) or {}).get(k)
            if x != y:
                problems.append(f"{section}.{k}: {x} vs {y}")
    for k in ("source_file_sha256", "source_config_sha256"):
        if a.get(k) != b.get(k):
            problems.append(f"{k}: the records come from different source checkpoints")
    return problems


def _timing(record: dict) -> str:
    """Device and time of a conversion: its layers' seconds summed (a resumed conversion's ``elapsed_s``
    counts only the last process)."""
    seconds = [x for x in record["layerwise"]["seconds_per_layer"] if x]
    return (
        f"{record['layerwise']['device']}, its {len(seconds)} layers {sum(seconds):,.0f} s in all (median "
        f"{statistics.median(seconds):,.1f} s a layer), created {record['created']}"
    )


def compare(a: dict, b: dict, names: tuple[str, str]) -> str:
    """A markdown report: the per-layer table and the summary lines."""
    na, nb = names
    merge_diff = max(
        abs(x[k] - y[k])
        for x, y in zip(a["reconstruction_error"], b["reconstruction_error"], strict=True)
        for k in ("key", "value")
    )
    rows, ratios, before_ratios = [], [], []
    for x, y in zip(a["refine"]["attention_error"], b["refine"]["attention_error"], strict=True):
        ratio = y["heldout_after"] / x["heldout_after"]
        ratios.append(ratio)
        before_ratios.append(y["heldout_before"] / x["heldout_before"])
        rows.append(
            f"| {x['layer']} | {x['heldout_before']:.6f} | {y['heldout_before']:.6f} | "
            f"{x['heldout_after']:.6f} | {y['heldout_after']:.6f} | {ratio:.3f} | "
            f"{x['best_step']} | {y['best_step']} |"
        )
    dev = [abs(r - 1) for r in ratios]
    dev_before = [abs(r - 1) for r in before_ratios]
    total = sum(y["heldout_after"] for y in b["refine"]["attention_error"]) / sum(
        x["heldout_after"] for x in a["refine"]["attention_error"]
    )
    head = [
        f"# One conversion on {na} and on {nb}",
        "",
        f"`{' '.join(['python', *sys.argv])}`",
        "",
        f"- {na}: {_timing(a)}",
        f"- {nb}: {_timing(b)}",
        f"- the same settings: {a['calibration']['tokens']:,} calibration tokens, "
        f"{a['refine']['steps']} refinement steps per layer fitted to {a['refine']['target']} "
        f"({a['refine']['loss']} loss), seed {a['refine']['seed']}",
        f"- the merge (solved on the original's inputs): key/value errors differ by at most {merge_diff:.1e} "
        "(recorded to 6 decimals)",
        f"- held-out error after refinement, {nb} over {na}: median |ratio - 1| "
        f"{statistics.median(dev):.2%}, largest {max(dev):.2%} (layer {dev.index(max(dev))}); summed over "
        f"layers {total:.4f}x",
        "- held-out error of the merged layer before refinement (its inputs already carry the earlier "
        f"layers' refinement): median |ratio - 1| {statistics.median(dev_before):.2%}, "
        f"largest {max(dev_before):.2%} (layer {dev_before.index(max(dev_before))})",
        "",
        f"| layer | before, {na} | before, {nb} | after, {na} | after, {nb} | after {nb}/{na} | "
        f"best step, {na} | best step, {nb} |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    return "\n".join([*head, *rows]) + "\n"


def heldout_ppl(original: str, model: str, heldout: Path, seq_len: int, eval_tokens: int) -> str:
    """Markdown lines: the held-out perplexity of ORIGINAL and MODEL, as a recovery run measures them."""
    from gqakit.pipelines.recovery.options import Inputs, RecoveryOptions
    from gqakit.pipelines.recovery.run import recipe_data
    from gqakit.uptrain import recipe_from_dict, validation_perplexity

    o = RecoveryOptions(src=original, groups=1, seq_len=seq_len, eval_tokens=eval_tokens, device="cpu")
    inputs = Inputs(src=original, train=heldout, calibration=heldout, heldout=heldout)
    recipe = recipe_from_dict(recipe_data(o, inputs, original, Path("unused"), o.lr, "fp32"))
    ppl = {m: validation_perplexity(recipe, m)[0] for m in (original, model)}
    return (
        f"- held-out perplexity (float32, CPU, {eval_tokens:,} tokens of {heldout.name} in {seq_len}-token "
        f"blocks, as a recovery run scores them): the original {ppl[original]:.3f}, the first record's "
        f"model {ppl[model]:.3f} ({ppl[model] / ppl[original]:.3f}x)\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="the first conversion's gqakit.json")
    p.add_argument("b", type=Path, help="the second conversion's gqakit.json")
    p.add_argument("--names", default="a,b", help="what to call them in the report, comma-separated")
    p.add_argument("--out", type=Path, help="also write the report here")
    p.add_argument("--heldout-ppl", nargs=2, metavar=("ORIGINAL", "MODEL"), help="also score these two")
    p.add_argument("--heldout", type=Path, help="the held-out text for --heldout-ppl (one document a line)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--eval-tokens", type=int, default=16384)
    args = p.parse_args()
    a, b = (json.loads(path.read_text()) for path in (args.a, args.b))
    for path, record in ((args.a, a), (args.b, b)):
        if not (record.get("refine") and record.get("layerwise") and record.get("reconstruction_error")):
            raise SystemExit(
                f"{path} is not the record of a layer-wise calibrated + refined conversion (gqakit convert "
                "--method calibrated --refine-steps N): it has no per-layer errors to compare."
            )
    problems = settings_problems(a, b)
    if problems:
        raise SystemExit("the records are not the same conversion: " + "; ".join(problems))
    names = tuple(args.names.split(","))
    if len(names) != 2:
        raise SystemExit(f"--names takes two names, got {args.names!r}")
    report = compare(a, b, names)
    if args.heldout_ppl:
        if not args.heldout:
            raise SystemExit("--heldout-ppl needs --heldout FILE")
        report += "\n" + heldout_ppl(*args.heldout_ppl, args.heldout, args.seq_len, args.eval_tokens)
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
