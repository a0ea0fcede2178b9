"""The uptraining learning rate of ``gqakit replicate``: the same arms at several peak rates, side by side.

Runs the replicate pipeline once per rate into ``OUT/lr<rate>/`` on a shared working directory (the
tokenizer, the pretrained MHA model and the conversions are computed once), with seed 0, alphas 0, 0.05
and 0.1, MQA from mean, first, random and refined, and prints each arm's test perplexity per rate.

    python benchmarks/bench_replicate_lr.py --work-dir /tmp/replicate-work --out /tmp/replicate-lr \\
        --lrs 2e-4,5e-4,1e-3
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from gqakit.pipelines.replicate import run_replicate
from gqakit.pipelines.replicate.options import ReplicateOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lrs", default="2e-4,5e-4,1e-3")
    args = ap.parse_args()
    table: dict[str, dict[str, float]] = {}
    for lr in (float(x) for x in args.lrs.split(",")):
        o = ReplicateOptions(
            out=args.out / f"lr{lr:g}",
            work_dir=args.work_dir,
            seeds=(0,),
            alphas=(0.0, 0.05, 0.1),
            groups=(1,),
            methods=("mean", "first", "random", "refined"),
            uptrain_lr=lr,
            decode_rounds=1,
        )
        res = run_replicate(o)
        arms = json.loads(Path(res.results_json).read_text())["arms"]
        table[f"{lr:g}"] = {a["name"]: a["ppl"] for a in arms if a["ppl"] is not None}
    names = list(next(iter(table.values())))
    print("command: python " + shlex.join(sys.argv))
    print("arm".ljust(22) + "".join(f"lr {lr}".rjust(12) for lr in table))
    for n in names:
        print(n.ljust(22) + "".join(f"{table[lr].get(n, float('nan')):12,.2f}" for lr in table))
    (args.out / "summary.json").write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
