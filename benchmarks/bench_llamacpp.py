"""llama.cpp as the serving engine: correctness against transformers, and what fewer K/V heads buy there.

SmolLM2-135M in three forms of the same weights: MHA-9 (``gqakit expand``), the original GQA-3, and MQA
(``gqakit convert --groups 1``, mean pooling: for speed the weights' values do not matter, and quality is
compared engine against engine on the same form). Each form is exported to GGUF with gqakit's exporter.

1. Correctness: f32 GGUF with a float32 KV cache; llama.cpp's perplexity on the first ``--eval-tokens``
   wiki-en test tokens, over exactly the windows of gqakit's transformers perplexity, against
   transformers' (float32). Target: within 0.5%.
2. Speed: f16 GGUF (llama.cpp's default f16 KV cache), batch 1, one decode point per context; every
   model measured in each of ``--rounds`` rounds in a rotated order (a change of machine load hits every
   model), median tokens/s and spread per model. MQA and GQA-3 over MHA-9 as ratios, next to the
   bytes-moved bound: a decode step reads every weight once and the whole KV cache, so the speedup
   cannot exceed ``(W + KV_mha) / (W + KV_g)``, with W the GGUF's tensor bytes and KV the cache bytes
   at that context. KV MiB per model as llama.cpp allocates it (its log) beside the formula.

    python benchmarks/bench_llamacpp.py --model ~/.cache/gqakit/smollm2-135m/model \\
        --test ~/.cache/gqakit/wiki-en/test.txt --out benchmarks/results/llamacpp/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path


def build_forms(model: Path, work: Path) -> dict[str, Path]:
    """MHA-9, GQA-3 (the original) and MQA of the same weights, as checkpoints."""
    from gqakit.convert import ConvertOptions, convert_checkpoint, expand_checkpoint

    forms = {"MHA-9": work / "mha", "GQA-3": model, "MQA": work / "mqa"}
    if not (forms["MHA-9"] / "config.json").is_file():
        expand_checkpoint(model, forms["MHA-9"], force=True)
    if not (forms["MQA"] / "config.json").is_file():
        convert_checkpoint(model, forms["MQA"], ConvertOptions(groups=1, force=True))
    return forms


def export(path: Path, work: Path, name: str, out_type: str) -> Path:
    from gqakit.gguf.export import export_gguf

    dst = work / f"{name}-{out_type}.gguf"
    if not dst.is_file():
        export_gguf(path, dst, out_type=out_type)
    return dst


def correctness(forms: dict[str, Path], work: Path, test: Path, tokens: int, seq_len: int) -> list[dict]:
    from gqakit.eval import EvalOptions, perplexity
    from gqakit.eval.llamacpp_engine import llamacpp_perplexity
    from gqakit.models import load_causal_lm, load_tokenizer
    from gqakit.text import load_texts

    texts = load_texts(test)
    opts = EvalOptions(ppl_data=str(test), seq_len=seq_len, max_tokens=tokens)
    rows = []
    for name, path in forms.items():
        tok = load_tokenizer(path)
        model = load_causal_lm(path, dtype="float32", device="cpu")
        hf = perplexity(model, tok, texts, seq_len=seq_len, max_tokens=tokens, progress=False)
        del model
        lc = llamacpp_perplexity(export(path, work, name, "f32"), tok, texts, opts)
        rows.append(
            {"model": name, "tokens": hf.tokens, "transformers": hf.ppl, "llamacpp": lc.ppl,
             "relative_difference": lc.ppl / hf.ppl - 1, "llamacpp_s": lc.elapsed_s}
        )  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def speed(forms: dict[str, Path], work: Path, contexts: list[int], new_tokens: int, rounds: int) -> dict:
    from gqakit.checkpoint import read_config
    from gqakit.eval.llamacpp_engine import llamacpp_decode
    from gqakit.geometry import AttentionGeometry
    from gqakit.gguf.header import read_gguf_header

    ggufs = {name: export(path, work, name, "f16") for name, path in forms.items()}
    geoms = {name: AttentionGeometry.from_config(read_config(path)) for name, path in forms.items()}
    weights = {
        name: sum(_tensor_bytes(t) for t in read_gguf_header(g).tensors.values()) for name, g in ggufs.items()
    }
    tps: dict[str, dict[int, list[float]]] = {n: {c: [] for c in contexts} for n in forms}
    kv_alloc: dict[str, int | None] = {}
    names = list(forms)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            points = llamacpp_decode(ggufs[name], geoms[name], contexts, new_tokens, False, seed=r)
            kv_alloc[name] = points[-1].kv_bytes_predicted
            for p in points:
                tps[name][p.context].append(p.tokens_per_s)
        print(
            f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {tps[n][contexts[-1]][-1]:.1f}" for n in names),
            flush=True,
        )
    out = {"weights_bytes": weights, "kv_allocated_bytes": kv_alloc, "tokens_per_s": tps, "points": []}
    for c in contexts:
        for name in names:
            kv = {n: geoms[n].kv_bytes_per_token(dtype_bytes=2) * c for n in names}
            med = statistics.median(tps[name][c])
            base = statistics.median(tps["MHA-9"][c])
            bound = (weights["MHA-9"] + kv["MHA-9"]) / (weights[name] + kv[name])
            spread = (max(tps[name][c]) - min(tps[name][c])) / med
            out["points"].append(
                {"model": name, "context": c, "tokens_per_s": med, "spread": spread, "speedup": med / base,
                 "bound": bound, "of_bound": (med / base) / bound if bound > 1 else None}
            )  # fmt: skip
    return out


def _tensor_bytes(info: tuple[str, tuple[int, ...]]) -> int:
    dtype, shape = info
    n = 1
    for s in shape:
        n *= s
    return {"F32": 4, "F16": 2, "BF16": 2}.get(dtype, 1) * n + (n // 32 * 2 if dtype == "Q8_0" else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/gqakit/smollm2-135m/model")
    ap.add_argument("--test", type=Path, default=Path.home() / ".cache/gqakit/wiki-en/test.txt")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-bench-llamacpp"))
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import llama_cpp

    from gqakit.models import cpu_model

    args.workdir.mkdir(parents=True, exist_ok=True)
    forms = build_forms(args.model, args.workdir)
    res: dict = {"command": "python " + shlex.join(sys.argv), "llama_cpp_python": llama_cpp.__version__,
                 "cpu": cpu_model(), "threads": os.cpu_count(),
                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
    if not args.skip_correctness:
        res["correctness"] = correctness(forms, args.workdir, args.test, args.eval_tokens, args.seq_len)
    contexts = [int(c) for c in args.contexts.split(",")]
    res["speed"] = speed(forms, args.workdir, contexts, args.new_tokens, args.rounds)

    print(f"\n{res['command']}   (llama-cpp-python {llama_cpp.__version__}, {os.cpu_count()} threads)")
    if "correctness" in res:
        window = f"first {args.eval_tokens:,} test tokens, {args.seq_len}-token windows"
        print(f"\nperplexity, f32 GGUF and KV cache, {window}")
        print("| model | transformers | llama.cpp | difference |\n|---|---:|---:|---:|")
        for r in res["correctness"]:
            diff = f"{100 * r['relative_difference']:+.3f}%"
            print(f"| {r['model']} | {r['transformers']:.4f} | {r['llamacpp']:.4f} | {diff} |")
    s = res["speed"]
    rounds = f"median of {args.rounds} interleaved rounds (spread: max-min over median)"
    print(f"\ndecode, f16 GGUF, batch 1, {rounds}")
    print("| context | model | tokens/s | spread | speedup vs MHA-9 | bytes-moved bound | of bound |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for p in s["points"]:
        of = f"{100 * p['of_bound']:.0f}%" if p["of_bound"] is not None else "-"
        print(f"| {p['context']} | {p['model']} | {p['tokens_per_s']:.1f} | {100 * p['spread']:.0f}% | "
              f"{p['speedup']:.2f}x | {p['bound']:.2f}x | {of} |")  # fmt: skip
    print("\nKV cache as llama.cpp allocates it (f16):")
    for name, b in s["kv_allocated_bytes"].items():
        print(f"  {name}: {b / 2**20:.1f} MiB" if b else f"  {name}: not logged")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
