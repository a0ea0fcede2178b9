"""Where a converted model's zero-shot perplexity gap sits: the perplexity with one layer converted and
every other layer original, and with one layer restored to the original and every other layer converted.

A layer-wise refinement fits each layer on its own, so its per-layer errors say little about which
layers the model's perplexity suffers from (a 9% lower mean layer error moved SmolLM2-135M -> MQA's
perplexity 0.8%: docs/convert.md). This swaps whole decoder layers between the original and the
converted model in memory (each attention module keeps its own K/V head count, so a mixed model runs
as it is) and scores each mix on the same text:

    C=${GQAKIT_CACHE:-~/.cache/gqakit}
    python benchmarks/layer_attribution.py $C/smollm2-135m/model CONVERTED \
        --ppl-data $C/wiki-en/test.txt --max-tokens 4096 --out OUT.json

"alone" is the perplexity with only that layer converted; "restored" with only that layer original. If
the gap were the sum of independent layer costs, the "alone" increases would add up to the converted
model's and each "restored" gain would match its "alone" increase; the printed totals show how far they
do. The figures are printed with this command line, and written as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("original")
    ap.add_argument("converted")
    ap.add_argument("--ppl-data", required=True, help="a .txt / .jsonl / .parquet file, as gqakit eval takes")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()

    from gqakit.errors import GqakitError
    from gqakit.eval.perplexity import perplexity
    from gqakit.models import load_causal_lm, load_tokenizer
    from gqakit.text import load_texts

    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    try:  # a missing path or unreadable text: gqakit's one-line message, not a traceback
        tok = load_tokenizer(args.original)
        texts = load_texts(args.ppl_data)
        original = load_causal_lm(args.original, dtype="float32", device="cpu").eval()
        converted = load_causal_lm(args.converted, dtype="float32", device="cpu").eval()
    except GqakitError as e:
        sys.exit(f"Error: {e.message}")
    layers_a, layers_b = original.model.layers, converted.model.layers
    if len(layers_a) != len(layers_b):
        sys.exit(f"{args.converted} has {len(layers_b)} layers and {args.original} {len(layers_a)}.")

    def ppl(model) -> float:
        with torch.no_grad():
            result = perplexity(
                model, tok, texts, seq_len=args.seq_len, max_tokens=args.max_tokens, progress=False
            )
        return float(result.ppl)

    start = time.perf_counter()
    base, full = ppl(original), ppl(converted)
    rows = []
    for i in range(len(layers_a)):
        a, b = layers_a[i], layers_b[i]
        layers_a[i] = b  # the original with layer i converted
        alone = ppl(original)
        layers_a[i] = a
        layers_b[i] = a  # the converted model with layer i restored
        restored = ppl(converted)
        layers_b[i] = b
        rows.append({"layer": i, "alone": alone, "restored": restored})
        print(f"layer {i}: alone {alone:.3f}, restored {restored:.3f}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start

    log_gap = math.log(full / base)
    alone_sum = sum(math.log(r["alone"] / base) for r in rows)
    restored_sum = sum(math.log(full / r["restored"]) for r in rows)
    print(command)
    print(
        f"original {base:.3f}; converted {full:.3f} ({full / base:.3f}x); {args.max_tokens} tokens of "
        f"{args.ppl_data}, seq_len {args.seq_len}; {elapsed:.0f} s"
    )
    print(
        f"sum over layers of log(alone / original) = {alone_sum:.4f}, of log(converted / restored) = "
        f"{restored_sum:.4f}, against log(converted / original) = {log_gap:.4f}"
    )
    print("| layer | alone | x original | restored | x original | share of the log gap (restored) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = math.log(full / r["restored"]) / log_gap
        print(
            f"| {r['layer']} | {r['alone']:.3f} | {r['alone'] / base:.4f} | {r['restored']:.3f} | "
            f"{r['restored'] / base:.4f} | {share:.1%} |"
        )
    if args.out:
        record = {
            "command": command,
            "original": base,
            "converted": full,
            "seq_len": args.seq_len,
            "max_tokens": args.max_tokens,
            "elapsed_s": round(elapsed, 1),
            "layers": rows,
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
