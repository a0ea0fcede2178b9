"""Perplexity throughput: gqakit's evaluator vs lm-eval's rolling loglikelihood, same model and text.

    python benchmarks/bench_perplexity.py
    python benchmarks/bench_perplexity.py --device cuda --dtype bfloat16 --shape smollm2-135m \
        --tokens 400000 --seq-len 2048 --batch-size 16

A random-weight llama (``--shape small``: 4 layers, hidden 256, 4 heads, SmolLM2's vocabulary of
49152, so the output layer and log-softmax cost what they cost in a real small model;
``--shape smollm2-135m``: SmolLM2-135M's own shape, for a GPU) scores the shipped
``gqakit_ppl.txt``, repeated to ``--tokens`` tokens, with disjoint windows of ``--seq-len``. gqakit
runs ``perplexity(..., batch_size=B)``; lm-eval runs ``HFLM(pretrained=model).loglikelihood_rolling``
on the same text with ``max_length = seq_len`` at batch 1 (its default) and at the same batch B. The
runs are interleaved, the order rotating every round, and the table reports the median tokens/s of each
and the ratios. Both compute the same windows, so the total log-likelihoods must agree: to 1e-4
relative in float32, 5e-3 in half precision (batch shapes change the rounding); the table shows the
difference and the script exits non-zero after it when one is off.
Target (issue 3): gqakit >= 1.5x lm-eval.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from gqakit.eval.lm_eval_bridge import TASKS_DIR
from gqakit.eval.perplexity import perplexity
from gqakit.text import load_texts

SHAPES = {
    "small": dict(heads=4, layers=4, hidden=256),
    "smollm2-135m": dict(
        heads=9, kv_heads=3, layers=30, hidden=576, head_dim=64, intermediate_size=1536,
        tie_word_embeddings=True,
    ),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokens", type=int, default=16384, help="text tokens to score")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    args = ap.parse_args()

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/tiny_models.py
    from tiny_models import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    tok.model_max_length = 10**9
    model = tiny_model(
        "llama",
        **SHAPES[args.shape],
        vocab_size=49152,
        max_position_embeddings=max(args.seq_len, 256),
        dtype=getattr(torch, args.dtype),
    ).to(args.device)
    base = load_texts(TASKS_DIR / "gqakit_ppl.txt")[0]
    per_copy = len(tok(base, add_special_tokens=False)["input_ids"])
    text = "\n\n".join([base] * math.ceil(args.tokens / per_copy))
    n_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}, {args.dtype}; "
        f"{n_tokens} tokens, seq_len {args.seq_len}, batch {args.batch_size}, {args.rounds} rounds, "
        f"load avg {os.getloadavg()[0]:.1f}",
        flush=True,
    )

    def ours() -> tuple[float, float]:
        res = perplexity(model, tok, [text], seq_len=args.seq_len, batch_size=args.batch_size, progress=False)
        return res.elapsed_s, -res.nll_sum

    def lm_eval(batch: int):
        def run() -> tuple[float, float]:
            lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch, max_length=args.seq_len)
            req = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
            start = time.perf_counter()
            ll = lm.loglikelihood_rolling([req], disable_tqdm=True)[0]
            return time.perf_counter() - start, ll

        return run

    runners = {
        f"gqakit (batch {args.batch_size})": ours,
        "lm-eval (batch 1)": lm_eval(1),
        f"lm-eval (batch {args.batch_size})": lm_eval(args.batch_size),
    }
    ours()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in runners}
    lls: dict[str, float] = {}
    names = list(runners)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            with torch.inference_mode():
                elapsed, ll = runners[name]()
            times[name].append(elapsed)
            lls[name] = ll
            print(f"round {r} {name:20s} {n_tokens / elapsed:9.1f} tok/s  loglik {ll:.3f}", flush=True)
    ref = lls[names[0]]
    tolerance = 1e-4 if args.dtype == "float32" else 5e-3
    rel = {name: abs(ll - ref) / abs(ref) for name, ll in lls.items()}
    tps = {k: n_tokens / statistics.median(v) for k, v in times.items()}
    print("\n| evaluator | tokens/s (median) | gqakit speedup | log-likelihood vs gqakit |")
    print("|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {tps[name]:.1f} | {tps[names[0]] / tps[name]:.2f}× | {rel[name]:.1e} |")
    off = [name for name, r in rel.items() if r > tolerance]
    if off:
        raise SystemExit(f"log-likelihoods differ by more than {tolerance:g} relative: {', '.join(off)}")


if __name__ == "__main__":
    main()
