"""Refinement variants side by side: zero-shot held-out perplexity, conversion time and peak memory.

Each variant converts the same source with the calibrated merge and the same refinement budget (steps per
layer, calibration tokens), in a child process of its own (so its peak RSS is its own), then scores the
result on the first ``--eval-tokens`` tokens of held-out text, beside the original. Variants:

* ``attention``: each converted attention block fitted to the original block's output, one learning rate
  (``--refine-lr``) for every parameter;
* ``layer``: fitted to the original decoder layer's output, attention and MLP through the residual;
* ``qk-lr``: ``attention`` with the query/key side at its own learning rate (``--qk-lr``; the package's
  default is 3e-3 since this comparison);
* ``layer-all``, ``attention-corrective``, ``layer-corrective``, ``window``, ``window-corrective``: those
  ``--refine-target`` values, with the query/key side at ``--qk-lr``;
* ``cosine``: ``qk-lr`` with ``--refine-schedule cosine`` (the rates fall to 0 over each layer's steps);
* ``layer-qk-lr``: ``layer`` with the query/key side at ``--qk-lr``;
* ``layer``, ``layer-qk-lr``, ``layer-corrective`` and ``window`` measure with ``--refine-loss relative``
  (the loss they were first measured with; their default is now ``per-token``);
* ``per-token``, ``layer-per-token``, ``layer-corrective-per-token``, ``window-per-token``: ``qk-lr``,
  ``layer``, ``layer-corrective`` and ``window`` with ``--refine-loss per-token`` (each token's error
  over the mean square of the residual state it lands in);
* ``layer-all-per-token``: ``layer-all`` with ``--refine-loss per-token``; ``layer-all-corrective`` and
  ``layer-all-corrective-per-token``: that target (every weight of the layer moves, on the converted
  model's states) with each loss.

    C=${GQAKIT_CACHE:-~/.cache/gqakit}
    python benchmarks/bench_refine_variants.py --model smollm2-135m --groups 1 --steps 100 \\
        --calib-data $C/wiki-en/train.txt --eval-data $C/wiki-en/test.txt --seq-len 256 \\
        --out benchmarks/results/refine-variants/smollm2-mqa.json
    python benchmarks/bench_refine_variants.py --model replicate-mha --groups 1 --steps 100 \\
        --calib-data $C/wiki-en/train.txt --eval-data $C/wiki-en/test.txt --seq-len 128 \\
        --out benchmarks/results/refine-variants/replicate-mqa.json

``--model`` is a checkpoint directory or an asset name (``replicate-mha`` is built by
``gqakit replicate --pretrain-only``). ``--seeds 0,1,2`` repeats every variant with each refinement seed
(the order of the calibration batches) and adds the mean, the range and on how many seeds each variant
beat the first one: a difference smaller than the spread over seeds is not a win. Figures are printed
with this command line and the ratios to the first variant.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

_CHILD = textwrap.dedent(
    """
    import json, re, sys, time
    from gqakit.convert import ConvertOptions, convert_checkpoint
    src, dst, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak of the conversion alone, not of the imports
    t0 = time.perf_counter()
    convert_checkpoint(src, dst, ConvertOptions(**opts))
    seconds = time.perf_counter() - t0
    hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": hwm}))
    """
)

QK_LR = "--qk-lr"  # a placeholder, filled from the flag
VARIANTS = {
    "attention": {"refine_qk_lr": None},  # None: the query/key side at refine_lr too
    "layer": {"refine_target": "layer", "refine_qk_lr": None, "refine_loss": "relative"},
    "qk-lr": {"refine_qk_lr": QK_LR},
    "layer-all": {"refine_target": "layer-all", "refine_qk_lr": QK_LR},
    "attention-corrective": {"refine_target": "attention-corrective", "refine_qk_lr": QK_LR},
    "layer-corrective": {
        "refine_target": "layer-corrective",
        "refine_qk_lr": QK_LR,
        "refine_loss": "relative",
    },
    "window": {"refine_target": "window", "refine_qk_lr": QK_LR, "refine_loss": "relative"},
    "window-corrective": {"refine_target": "window-corrective", "refine_qk_lr": QK_LR},
    "cosine": {"refine_schedule": "cosine", "refine_qk_lr": QK_LR},
    "layer-qk-lr": {"refine_target": "layer", "refine_qk_lr": QK_LR, "refine_loss": "relative"},
    "per-token": {"refine_loss": "per-token", "refine_qk_lr": QK_LR},
    "layer-per-token": {"refine_target": "layer", "refine_loss": "per-token", "refine_qk_lr": QK_LR},
    "layer-corrective-per-token": {
        "refine_target": "layer-corrective",
        "refine_loss": "per-token",
        "refine_qk_lr": QK_LR,
    },
    "window-per-token": {"refine_target": "window", "refine_loss": "per-token", "refine_qk_lr": QK_LR},
    "layer-all-per-token": {"refine_target": "layer-all", "refine_loss": "per-token", "refine_qk_lr": QK_LR},
    "layer-all-corrective": {
        "refine_target": "layer-all-corrective",
        "refine_loss": "relative",
        "refine_qk_lr": QK_LR,
    },
    "layer-all-corrective-per-token": {
        "refine_target": "layer-all-corrective",
        "refine_loss": "per-token",
        "refine_qk_lr": QK_LR,
    },
}


def _model(name: str) -> str:
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    from gqakit.assets import fetch_asset

    return str(fetch_asset(name)["model"])


def _ppl(path: str, texts: list[str], seq_len: int, tokens: int) -> float:
    from gqakit.eval import perplexity
    from gqakit.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(path, dtype="float32", device="cpu")
    res = perplexity(model, load_tokenizer(path), texts, seq_len=seq_len, max_tokens=tokens, progress=False)
    return res.ppl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--calib-data", required=True)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--qk-lr", type=float, default=3e-4)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--eval-data", required=True)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seeds", default="0", help="comma-separated refinement seeds, one conversion each")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    from gqakit.text import load_texts

    src = _model(args.model)
    texts = load_texts(args.eval_data)
    original = _ppl(src, texts, args.seq_len, args.eval_tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="refine-variants-") as tmp:
        for seed in seeds:
            for name in args.variants.split(","):
                rows.append(_variant(name, seed, args, src, texts, original, Path(tmp) / f"{name}-{seed}"))
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    base = rows[0]
    print(f"\n{command}\noriginal: {original:.3f}")
    print("| variant | seed | zero-shot ppl | x original | time | x time | peak RSS | x RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['seed']} | {r['ppl']:.2f} | {r['ratio']:.3f} | {r['seconds']:.0f} s | "
            f"{r['seconds'] / base['seconds']:.2f} | {r['peak_rss'] / 2**30:.2f} GiB | "
            f"{r['peak_rss'] / base['peak_rss']:.2f} |"
        )
    summary = _summary(rows)
    if len(seeds) > 1:
        print(f"\nover seeds {args.seeds}:")
        print("| variant | mean ppl | min | max | below the first variant on |")
        print("|---|---:|---:|---:|---:|")
        for v in summary:
            print(
                f"| {v['variant']} | {v['mean_ppl']:.2f} | {v['min_ppl']:.2f} | {v['max_ppl']:.2f} | "
                f"{v['wins']}/{len(seeds)} seeds |"
            )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": command, "original_ppl": original, "settings": vars(args), "rows": rows,
            "summary": summary,
        }  # fmt: skip
        out.write_text(json.dumps(result, indent=2) + "\n")


def _variant(
    name: str, seed: int, args: argparse.Namespace, src: str, texts: list[str], original: float, dst: Path
) -> dict:
    """Convert ``src`` with variant ``name`` and refinement seed ``seed`` in a child process; score it."""
    opts = {
        "groups": args.groups, "method": "calibrated", "calib_data": args.calib_data,
        "calib_tokens": args.calib_tokens, "refine_steps": args.steps, "device": "cpu", "seed": seed,
        **{k: (args.qk_lr if v == QK_LR else v) for k, v in VARIANTS[name].items()},
    }  # fmt: skip
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, src, str(dst), json.dumps(opts)],
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    ppl = _ppl(str(dst), texts, args.seq_len, args.eval_tokens)
    print(
        f"{name} seed {seed}: ppl {ppl:.3f} ({ppl / original:.3f}x), {measured['seconds']:.0f} s", flush=True
    )
    return {"variant": name, "seed": seed, "options": opts, "ppl": ppl, "ratio": ppl / original, **measured}


def _summary(rows: list[dict]) -> list[dict]:
    """Per variant: mean, min and max perplexity over the seeds, and on how many seeds it scored below
    the first variant converted with the same seed."""
    first = rows[0]["variant"]
    base = {r["seed"]: r["ppl"] for r in rows if r["variant"] == first}
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        ppls = [r["ppl"] for r in mine]
        out.append(
            {
                "variant": name, "mean_ppl": sum(ppls) / len(ppls), "min_ppl": min(ppls),
                "max_ppl": max(ppls), "wins": sum(r["ppl"] < base[r["seed"]] for r in mine),
                "seeds": len(mine),
            }
        )  # fmt: skip
    return out


if __name__ == "__main__":
    main()
