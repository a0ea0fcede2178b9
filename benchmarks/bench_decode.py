"""Decode speed of MHA vs GQA vs MQA forms of one model, next to the bound that bytes moved predict.

    python benchmarks/bench_decode.py                          # CPU, SmolLM2-135M shape, random weights
    python benchmarks/bench_decode.py --device cuda --dtype bfloat16 --batch-sizes 1,8,32 \\
        --contexts 512,2048,8192                                 # GPU, larger grid

Builds a random-weight model of SmolLM2-135M's shape (30 layers, hidden 576, 9 query heads of 64,
MLP 1536, vocab 49152, tied embeddings), saves it, and converts it with ``gqakit convert`` to GQA-3 and
MQA (``--model DIR`` uses a real MHA checkpoint instead). The three forms are measured interleaved:
for every round and context, each model runs the same point in turn (the order rotates per round), so
load from other processes hits all three alike; the table shows the median over rounds of each point's
median per-token latency. Speed is reported as tokens/s at batch B (B / per-step latency).

Bound: the bytes one decode step moves, weights read once + the KV cache at the mean decode position
(:func:`gqakit.eval.kv_bytes.bytes_moved_per_step`); the MHA model's bytes over the candidate's is the
speedup memory traffic allows. Target (issue 3): measured speedup >= 70% of that at the longest context.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gqakit.convert import ConvertOptions, convert_checkpoint
from gqakit.eval.decode import bench_decode
from gqakit.eval.kv_bytes import bytes_moved_per_step
from gqakit.models import load_causal_lm

SMOLLM2_135M = dict(
    heads=9,
    kv_heads=9,
    layers=30,
    hidden=576,
    head_dim=64,
    vocab_size=49152,
    intermediate_size=1536,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def build_models(root: Path, src: str | None) -> dict[str, Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/tiny_models.py
    from tiny_models import save_tiny_model

    mha = Path(src) if src else save_tiny_model(root / "mha", "llama", **SMOLLM2_135M)
    heads = json.loads((mha / "config.json").read_text())["num_attention_heads"]
    gqa_groups = 3 if heads % 3 == 0 else 2
    convert_checkpoint(mha, root / "gqa", ConvertOptions(groups=gqa_groups))
    convert_checkpoint(mha, root / "mqa", ConvertOptions(groups=1))
    return {f"MHA-{heads}": mha, f"GQA-{gqa_groups}": root / "gqa", "MQA": root / "mqa"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a real MHA checkpoint (default: random SmolLM2-135M shape)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="8")
    ap.add_argument("--contexts", default="512,1024,2048")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--static-cache", action="store_true")
    ap.add_argument(
        "--prefill",
        choices=["random", "model"],
        default="random",
        help="random: fill the cache with random K/V (same decode cost, no minutes of CPU prefill); "
        "model: run and time the real prefill",
    )
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batch_sizes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]

    tmp = tempfile.TemporaryDirectory()  # kept until exit: loaded weights may be memory-mapped
    paths = build_models(Path(tmp.name), args.model)
    models = {k: load_causal_lm(p, dtype=args.dtype, device=args.device) for k, p in paths.items()}
    names = list(models)
    base = names[0]
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
        f"dtype {args.dtype}, new_tokens {args.new_tokens}, rounds {args.rounds}, "
        f"{'static' if args.static_cache else 'dynamic'} cache, {args.prefill} prefill, "
        f"load avg {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for m in models.values():  # warm-up: allocator, kernels, first-call overheads
        bench_decode(
            m,
            batch_sizes=[batches[0]],
            contexts=[32],
            new_tokens=4,
            warmup=0,
            progress=False,
            static_cache=args.static_cache,
            prefill=args.prefill,
        )

    runs: dict[tuple[str, int, int], list[dict]] = {}
    for r in range(args.rounds):
        for b in batches:
            for c in contexts:
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    t0 = time.perf_counter()
                    p = bench_decode(
                        models[name],
                        batch_sizes=[b],
                        contexts=[c],
                        new_tokens=args.new_tokens,
                        warmup=0,
                        progress=False,
                        static_cache=args.static_cache,
                        prefill=args.prefill,
                    )[0]
                    runs.setdefault((name, b, c), []).append(p.to_dict())
                    print(
                        f"round {r} {name:7s} b={b} ctx={c}: {p.status} "
                        f"{p.tokens_per_s or 0:8.1f} tok/s  prefill {p.prefill_s or 0:6.1f}s  "
                        f"({time.perf_counter() - t0:.0f}s, load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )

    def med(name: str, b: int, c: int) -> float | None:
        vals = [p["tokens_per_s"] for p in runs[(name, b, c)] if p["status"] == "ok"]
        return statistics.median(vals) if vals else None

    rows = []
    print(
        "\n| batch | context | "
        + " | ".join(f"{n} tok/s" for n in names)
        + " | "
        + " | ".join(f"{n}/{base} measured | bound | % of bound" for n in names[1:])
        + " |"
    )
    print("|" + "---:|" * (2 + len(names) + 3 * (len(names) - 1)))
    for b in batches:
        for c in contexts:
            tps = {n: med(n, b, c) for n in names}
            moved = {n: bytes_moved_per_step(models[n], b, c + args.new_tokens // 2) for n in names}
            cells = [str(b), str(c)] + [f"{tps[n]:.1f}" if tps[n] else "OOM" for n in names]
            row = {"batch": b, "context": c, "tokens_per_s": tps, "bytes_per_step": moved}
            for n in names[1:]:
                bound = moved[base] / moved[n]
                speed = tps[n] / tps[base] if tps[n] and tps[base] else None
                cells += [
                    f"{speed:.2f}×" if speed else "–",
                    f"{bound:.2f}×",
                    f"{100 * speed / bound:.0f}%" if speed else "–",
                ]
                row[f"{n}_speedup"], row[f"{n}_bound"] = speed, bound
            rows.append(row)
            print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "argv": sys.argv,
                    "rows": rows,
                    "runs": {f"{k[0]}|{k[1]}|{k[2]}": v for k, v in runs.items()},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
