"""Refinement variants side by side: zero-shot held-out perplexity, conversion time and peak memory.

Each variant converts the same source with the calibrated merge and the same refinement budget (steps per
layer, calibration tokens), in a child process of its own (so its peak RSS is its own), then scores the
result on the first ``--eval-tokens`` tokens of held-out text, beside the original. Variants:

* ``attention``: each converted attention block fitted to the original block's output (the default);
* ``layer``: fitted to the original decoder layer's output, attention and MLP through the residual;
* ``qk-lr``: ``attention`` with the query/key side at its own learning rate (``--qk-lr``).

    C=${GQAKIT_CACHE:-~/.cache/gqakit}
    python benchmarks/bench_refine_variants.py --model smollm2-135m --groups 1 --steps 100 \\
        --calib-data $C/wiki-en/train.txt --eval-data $C/wiki-en/test.txt --seq-len 256 \\
        --out benchmarks/results/refine-variants/smollm2-mqa.json
    python benchmarks/bench_refine_variants.py --model replicate-mha --groups 1 --steps 100 \\
        --calib-data $C/wiki-en/train.txt --eval-data $C/wiki-en/test.txt --seq-len 128 \\
        --out benchmarks/results/refine-variants/replicate-mqa.json

``--model`` is a checkpoint directory or an asset name (``replicate-mha`` is built by
``gqakit replicate --pretrain-only``). Figures are printed with this command line and the ratios to the
first variant.
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

VARIANTS = {
    "attention": {},
    "layer": {"refine_target": "layer"},
    "qk-lr": {"refine_qk_lr": None},  # filled from --qk-lr
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from gqakit.text import load_texts

    src = _model(args.model)
    texts = load_texts(args.eval_data)
    original = _ppl(src, texts, args.seq_len, args.eval_tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="refine-variants-") as tmp:
        for name in args.variants.split(","):
            opts = {
                "groups": args.groups, "method": "calibrated", "calib_data": args.calib_data,
                "calib_tokens": args.calib_tokens, "refine_steps": args.steps, "device": "cpu",
                **{k: (args.qk_lr if v is None else v) for k, v in VARIANTS[name].items()},
            }  # fmt: skip
            dst = Path(tmp) / name
            child = subprocess.run(
                [sys.executable, "-c", _CHILD, src, str(dst), json.dumps(opts)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            measured = json.loads(child.stdout.strip().splitlines()[-1])
            ppl = _ppl(str(dst), texts, args.seq_len, args.eval_tokens)
            rows.append({"variant": name, "options": opts, "ppl": ppl, "ratio": ppl / original, **measured})
            print(f"{name}: ppl {ppl:.3f} ({ppl / original:.3f}x), {measured['seconds']:.0f} s", flush=True)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    base = rows[0]
    print(f"\n{command}\noriginal: {original:.3f}")
    print("| variant | zero-shot ppl | x original | time | x time | peak RSS | x RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['ppl']:.2f} | {r['ratio']:.3f} | {r['seconds']:.0f} s | "
            f"{r['seconds'] / base['seconds']:.2f} | {r['peak_rss'] / 2**30:.2f} GiB | "
            f"{r['peak_rss'] / base['peak_rss']:.2f} |"
        )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {"command": command, "original_ppl": original, "settings": vars(args), "rows": rows}
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
