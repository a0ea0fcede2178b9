"""Uptraining budgets and schedules from a calibrated + refined start, side by side.

The demo's shipped recipe (``recipes/smollm2-135m-mqa.yaml``: 30 steps of distillation, warmup then
cosine) was tuned for a start as poor as mean-pooled MQA. From a refined start, validation perplexity no
longer moves in its second half. This benchmark uptrains one refined start with each candidate
(overrides of ``recipes/smollm2-135m-mqa-refined.yaml``), each from the same data order and seed, and
scores every result on the demo's evaluation (the first 8,192 wiki-en test tokens in 512-token
windows), so the recipe for refined starts is chosen by measurement.

    gqakit convert $C/smollm2-135m/model /tmp/mqa-refined --groups 1 --method calibrated \\
        --calib-data $C/wiki-en/train.txt --refine-steps 200
    python benchmarks/bench_refined_recipe.py --start /tmp/mqa-refined --teacher $C/smollm2-135m/model \\
        --out benchmarks/results/refined-recipe.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

# name -> overrides of recipes/smollm2-135m-mqa-refined.yaml
# (the schedule is spelled out in every candidate, so they do not depend on what the recipe ships with)
CANDIDATES: dict[str, list[str]] = {
    "30 steps, cosine (the mean-pool recipe's schedule)": ["budget.tokens=30720", "train.min_lr_ratio=0.1"],
    "15 steps, cosine": ["budget.tokens=15360", "train.min_lr_ratio=0.1"],
    "15 steps, constant lr": ["budget.tokens=15360", "train.min_lr_ratio=1.0"],
    "15 steps, cosine, lr 1e-4": ["budget.tokens=15360", "train.min_lr_ratio=0.1", "train.lr=1e-4"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", required=True, help="a calibrated + refined MQA checkpoint")
    ap.add_argument("--teacher", required=True, help="the original model")
    ap.add_argument("--cache", default=str(Path.home() / ".cache/gqakit"), help="gqakit's asset cache")
    ap.add_argument("--workdir", default="/tmp/gqakit-bench-refined-recipe")
    ap.add_argument("--candidates", default=",".join(str(i) for i in range(len(CANDIDATES))))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from gqakit.eval import perplexity
    from gqakit.models import load_causal_lm, load_tokenizer
    from gqakit.text import load_texts
    from gqakit.uptrain import load_recipe, uptrain
    from gqakit.uptrain.metrics import read_history

    wiki = Path(args.cache) / "wiki-en"
    texts = load_texts(wiki / "test.txt")

    def score(path: Path) -> float:
        model = load_causal_lm(path, dtype="float32", device="cpu")
        res = perplexity(
            model,
            load_tokenizer(path),
            texts,
            seq_len=args.seq_len,
            max_tokens=args.eval_tokens,
            progress=False,
        )
        return res.ppl

    rows = [{"candidate": "start (no uptraining)", "test_ppl": score(Path(args.start))}]
    print(json.dumps(rows[-1]), flush=True)
    chosen = [list(CANDIDATES)[int(i)] for i in args.candidates.split(",")]
    for i, name in enumerate(chosen):
        paths = [
            f"model.path={args.start}",
            "model.convert=null",
            f"teacher={args.teacher}",
            f"data.files=[{wiki / 'train.txt'}]",
            f"data.val_files=[{wiki / 'validation.txt'}]",
            f"output_dir={Path(args.workdir) / f'run-{i}'}",
            f"seed={args.seed}",
            "log.progress=false",
        ]
        recipe = load_recipe("smollm2-135m-mqa-refined", [*paths, *CANDIDATES[name]])
        t = time.perf_counter()
        res = uptrain(recipe, force=True)
        val = [(h["step"], round(h["val_ppl"], 2)) for h in read_history(res.output_dir) if "val_ppl" in h]
        rows.append(
            {
                "candidate": name,
                "overrides": CANDIDATES[name],
                "steps": res.steps,
                "tokens": res.tokens,
                "uptrain_s": round(time.perf_counter() - t, 1),
                "validation_ppl": val,
                "test_ppl": score(res.output_dir),
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    print(f"\ncommand: python {shlex.join(sys.argv)}")
    print(f"test perplexity: first {args.eval_tokens:,} wiki-en test tokens, {args.seq_len}-token windows")
    print("| candidate | tokens | uptrain s | validation ppl (step: ppl) | test ppl |")
    print("|---|---:|---:|---|---:|")
    for r in rows:
        val = ", ".join(f"{s}: {p}" for s, p in r.get("validation_ppl", []))
        cells = [r["candidate"], f"{r.get('tokens', 0):,}", str(r.get("uptrain_s", "")), val]
        print(f"| {' | '.join(cells)} | {r['test_ppl']:.2f} |")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"command": shlex.join(sys.argv), "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
