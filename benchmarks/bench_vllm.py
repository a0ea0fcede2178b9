"""vLLM as the serving engine: correctness against transformers, and the capacity and throughput G buys.

SmolLM2-135M in the demo's three forms: MHA-9 (``gqakit expand``), GQA-3 and MQA (``gqakit convert`` from
MHA-9, mean pooling), float32, each loaded by ``gqakit eval --engine vllm`` as the checkpoint directory it
is, in one run:

1. Perplexity on the first ``--eval-tokens`` wiki-en test tokens over exactly the transformers engine's
   windows, vLLM (prompt log-probabilities) against transformers; target: within 1e-3 relative.
2. KV capacity vLLM allocates in ``--kv-budget`` GiB: each model's tokens over MHA-9's beside H/G.
3. Output tokens/s at each concurrency, ``--prompt-tokens`` random prompt tokens and ``--new-tokens``
   output tokens per sequence. The three models are loaded in vLLM at once and every round runs every
   (model, concurrency) point in a rotated order, so a change of machine load hits all models alike
   (``gqakit eval`` measures one model after another); ``--rounds`` rounds, the median, its spread, and
   each ratio to MHA-9 beside its bytes-moved bound (no ratio where the rounds disagree).

    GQAKIT_VLLM_PYTHON=~/.cache/gqakit-vllm/venv/bin/python python benchmarks/bench_vllm.py \\
        --out benchmarks/results/vllm/smollm2-cpu-float32.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from relative_paths import relative_text

from gqakit.convert import ConvertOptions, convert_checkpoint, expand_checkpoint
from gqakit.eval import EvalOptions, evaluate_models
from gqakit.eval.decode import interleaved, round_stats, speedup
from gqakit.eval.vllm_engine import VllmWorker, require_vllm
from gqakit.models import cpu_model
from gqakit.storage import cache_root


def build_forms(model: Path, work: Path) -> dict[str, str]:
    """MHA-9, GQA-3 and MQA of the same weights (the demo's models), built once under ``work``."""
    forms = {"MHA-9": work / "mha-9", "GQA-3": work / "gqa-3", "MQA": work / "mqa"}
    if not (forms["MHA-9"] / "config.json").is_file():
        expand_checkpoint(model, forms["MHA-9"], force=True)
    for name, g in (("GQA-3", 3), ("MQA", 1)):
        if not (forms[name] / "config.json").is_file():
            convert_checkpoint(forms["MHA-9"], forms[name], ConvertOptions(groups=g, force=True))
    return {k: str(v) for k, v in forms.items()}


def throughput(vl, forms: dict[str, str], conc: list[int], args) -> dict[str, list[dict]]:
    """Every (model, concurrency) point in each of ``args.rounds`` rounds, all three models loaded at once;
    per model, a row per concurrency with its rounds, median, spread, ratio to MHA-9 and bound."""
    python, names = require_vllm(), list(forms)
    points = [(name, c) for name in names for c in conc]
    with ExitStack() as stack:
        workers = {
            name: stack.enter_context(
                VllmWorker(
                    path, python, dtype="float32", kv_budget_gib=args.kv_budget,
                    max_model_len=args.prompt_tokens + args.new_tokens, head_dim=vl.models[name].head_dim,
                )
            )
            for name, path in forms.items()
        }  # fmt: skip
        for w in workers.values():  # one untimed request each: first-call costs
            w.request("throughput", concurrency=1, prompt_tokens=8, output_tokens=4, seed=0)

        def one(i: int, r: int) -> float:
            name, c = points[i]
            reply = workers[name].request(
                "throughput", concurrency=c, prompt_tokens=args.prompt_tokens,
                output_tokens=args.new_tokens, seed=r,
            )  # fmt: skip
            return reply["output_tokens"] / reply["seconds"]

        runs = interleaved(len(points), args.rounds, one)
    stats = {p: round_stats(r) for p, r in zip(points, runs, strict=True)}
    out: dict[str, list[dict]] = {}
    for name in names:
        m, base = vl.models[name], vl.models[names[0]]
        out[name] = []
        for c in conc:
            tokens = c * (args.prompt_tokens + args.new_tokens // 2)  # the mean decode position
            bound = (base.weight_bytes + base.kv_bytes_per_token * tokens) / (
                m.weight_bytes + m.kv_bytes_per_token * tokens
            )
            st, ratio = stats[(name, c)], speedup(stats[(name, c)], stats[(names[0], c)])
            out[name].append(
                {"concurrency": c, "tokens_per_s": st.median, "rounds": list(st.rounds), "spread": st.spread,
                 "reliable": st.reliable, "ratio": ratio, "bound": bound}
            )  # fmt: skip
    return out


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
        EvalOptions(**common, engine="vllm", new_tokens=args.new_tokens, kv_budget=args.kv_budget),
    )
    speeds = throughput(vl, forms, [int(c) for c in args.concurrency.split(",")], args)
    base = vl.models["MHA-9"]
    rows = []
    for name, m in vl.models.items():
        ppl_hf, ppl_vllm = hf.models[name].perplexity.ppl, m.perplexity.ppl
        s = m.serving
        rows.append(
            {
                "model": name,
                "kv_heads": m.num_kv_heads,
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "ppl_transformers": ppl_hf,
                "ppl_vllm": ppl_vllm,
                "ppl_relative_difference": ppl_vllm / ppl_hf - 1,
                "ppl_tokens": m.perplexity.tokens,
                "kv_capacity_tokens": s.kv_tokens,
                "capacity_ratio": s.kv_tokens / base.serving.kv_tokens,
                "capacity_bound": base.kv_bytes_per_token / m.kv_bytes_per_token,
                "max_sequences_at_seq_len": s.max_sequences,
                "throughput": speeds[name],
            }
        )
    for r in rows:
        print(
            f"{r['model']:6} G={r['kv_heads']}: ppl {r['ppl_vllm']:.4f} vLLM vs {r['ppl_transformers']:.4f} "
            f"transformers ({100 * r['ppl_relative_difference']:+.4f}%), "
            f"KV {r['kv_capacity_tokens']:,} tokens ({r['capacity_ratio']:.2f}x, bound "
            f"{r['capacity_bound']:.2f}x)"
        )
        for t in r["throughput"]:
            ratio = t["ratio"]
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
        "cpu": cpu_model(),
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
