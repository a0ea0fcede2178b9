"""vLLM as the serving engine: correctness against transformers, and the capacity and throughput G buys.

SmolLM2-135M in the demo's three forms: MHA-9 (``gqakit expand``), GQA-3 and MQA (``gqakit convert`` from
MHA-9, mean pooling), float32, each loaded by ``gqakit eval --engine vllm`` as the checkpoint directory it
is, in one run:

1. Perplexity on the first ``--eval-tokens`` wiki-en test tokens over exactly the transformers engine's
   windows, vLLM (prompt log-probabilities) against transformers; target: within 1e-3 relative.
2. Greedy continuations of the engine's four fixed prompts (``--new-tokens`` each), token by token.
3. KV capacity vLLM allocates in ``--kv-budget`` GiB: each model's tokens over MHA-9's beside H/G.
4. Output tokens/s at each concurrency, ``--prompt-tokens`` random prompt tokens and ``--new-tokens``
   output tokens per sequence, ``--rounds`` interleaved rounds: the median, its spread, and each ratio
   to MHA-9 beside its bytes-moved bound (no ratio where the rounds disagree).

    GQAKIT_VLLM_PYTHON=~/.cache/gqakit-vllm/venv/bin/python python benchmarks/bench_vllm.py \\
        --out benchmarks/results/vllm/smollm2-cpu-float32.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from relative_paths import relative_text

from gqakit.convert import ConvertOptions, convert_checkpoint, expand_checkpoint
from gqakit.eval import EvalOptions, evaluate_models
from gqakit.files import cache_root


def build_forms(model: Path, work: Path) -> dict[str, str]:
    """MHA-9, GQA-3 and MQA of the same weights (the demo's models), built once under ``work``."""
    forms = {"MHA-9": work / "mha-9", "GQA-3": work / "gqa-3", "MQA": work / "mqa"}
    if not (forms["MHA-9"] / "config.json").is_file():
        expand_checkpoint(model, forms["MHA-9"], force=True)
    for name, g in (("GQA-3", 3), ("MQA", 1)):
        if not (forms[name] / "config.json").is_file():
            convert_checkpoint(forms["MHA-9"], forms[name], ConvertOptions(groups=g, force=True))
    return {k: str(v) for k, v in forms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=cache_root() / "smollm2-135m/model")
    ap.add_argument("--test", type=Path, default=cache_root() / "wiki-en/test.txt")
    ap.add_argument("--workdir", type=Path, default=cache_root() / "bench-vllm")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-budget", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    forms = build_forms(args.model, args.workdir)
    common = dict(
        ppl_data=str(args.test), seq_len=args.seq_len, max_tokens=args.eval_tokens, device="cpu",
        dtype="float32", progress=False,
    )  # fmt: skip
    start = time.perf_counter()
    hf = evaluate_models(forms, EvalOptions(**common))
    vl = evaluate_models(
        forms,
        EvalOptions(
            **common, engine="vllm", bench=True, batch_sizes=args.concurrency,
            contexts=str(args.prompt_tokens), new_tokens=args.new_tokens, rounds=args.rounds,
            kv_budget=args.kv_budget,
        ),
    )  # fmt: skip
    comps = vl.comparisons()
    base = vl.models["MHA-9"]
    rows = []
    for name, m in vl.models.items():
        ppl_hf, ppl_vllm = hf.models[name].perplexity.ppl, m.perplexity.ppl
        s = m.serving
        dec = {d["batch"]: d for d in comps.get(name, {}).get("decode", [])}
        rows.append(
            {
                "model": name,
                "kv_heads": m.num_kv_heads,
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "ppl_transformers": ppl_hf,
                "ppl_vllm": ppl_vllm,
                "ppl_relative_difference": ppl_vllm / ppl_hf - 1,
                "ppl_tokens": m.perplexity.tokens,
                "greedy_identical": s.greedy.describe(),
                "kv_capacity_tokens": s.kv_tokens,
                "capacity_ratio": s.kv_tokens / base.serving.kv_tokens,
                "capacity_bound": base.kv_bytes_per_token / m.kv_bytes_per_token,
                "max_sequences_at_seq_len": s.max_sequences,
                "throughput": [
                    {
                        "concurrency": p.batch,
                        "tokens_per_s": p.tokens_per_s,
                        "rounds": p.rounds,
                        "spread": p.spread,
                        "reliable": p.reliable,
                        "ratio": dec[p.batch]["speedup"] if p.batch in dec else 1.0,
                        "bound": dec[p.batch]["bound"] if p.batch in dec else 1.0,
                    }
                    for p in m.decode
                ],
            }
        )
    for r in rows:
        print(
            f"{r['model']:6} G={r['kv_heads']}: ppl {r['ppl_vllm']:.4f} vLLM vs {r['ppl_transformers']:.4f} "
            f"transformers ({100 * r['ppl_relative_difference']:+.4f}%), greedy {r['greedy_identical']}, "
            f"KV {r['kv_capacity_tokens']:,} tokens ({r['capacity_ratio']:.2f}x, bound "
            f"{r['capacity_bound']:.2f}x)"
        )
        for t in r["throughput"]:
            ratio = f"{t['ratio']:.2f}x" if t["ratio"] else "unreliable"
            print(
                f"    concurrency {t['concurrency']:4}: {t['tokens_per_s']:7.1f} tok/s "
                f"±{100 * t['spread']:.0f}% ({ratio}, bound {t['bound']:.2f}x)"
            )
    command = "python " + shlex.join(sys.argv)
    print(f"\n{command}")
    res = {
        "command": command,
        "vllm": base.serving.engine,
        "environment": vl.environment,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "dtype": "float32",
        "kv_budget_gib": args.kv_budget,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "elapsed_s": round(time.perf_counter() - start),
        "models": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(res, indent=2) + "\n"
        args.out.write_text(relative_text(text, [str(cache_root())], [os.getcwd(), "/tmp"]))


if __name__ == "__main__":
    main()
