"""Peak memory and time of calibrated conversion, layer by layer, on a Llama-2-7B-shaped checkpoint.

Converts ``SRC`` (build it with ``benchmarks/make_llama7b_shaped.py``) in a child process, as a user
would run ``gqakit convert``, and reports:

- peak RSS (``ru_maxrss`` of the child, from ``wait4``) against the budget
  ``3 x (one decoder layer in float32) + embedding (float32) + calibration hidden states (float32)``;
- wall time per layer (from the output's gqakit.json) and in total; a flat per-layer time means total
  time grows linearly with depth.

    python benchmarks/bench_layerwise.py /tmp/llama7b-mha --groups 8 --calib-tokens 2048 \\
        --refine-steps 10 --out benchmarks/results/layerwise-7b.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_child(argv: list[str]) -> dict:
    """Run ``argv``; return its wall time, exit status and peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read() if proc.stderr else ""
    signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return {
        "wall_s": round(time.perf_counter() - start, 1),
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": signal,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "stderr_tail": stderr[-600:],
    }


def budget(config: dict, calib_tokens: int) -> dict:
    """The memory budget of the layer-by-layer path, in bytes, from the model's shape."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads
    layer = 4 * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i + 2 * h)
    embedding = 4 * v * h
    hidden_states = 4 * calib_tokens * h
    return {
        "layer_f32": layer,
        "embedding_f32": embedding,
        "hidden_states_f32": hidden_states,
        "budget": 3 * layer + embedding + hidden_states,
    }


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--calib-data", default=str(Path.home() / ".cache/gqakit/wiki-en/train.txt"))
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--refine-steps", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-bench-layerwise"))
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    config = json.loads((args.src / "config.json").read_text())
    args.workdir.mkdir(parents=True, exist_ok=True)
    dst = args.workdir / "layerwise"
    shutil.rmtree(dst, ignore_errors=True)
    gqakit = [sys.executable, "-m", "gqakit.cli"]
    cmd = [
        *gqakit, "convert", str(args.src), str(dst), "--groups", str(args.groups),
        "--method", "calibrated",
        "--calib-data", args.calib_data, "--calib-tokens", str(args.calib_tokens),
        "--refine-steps", str(args.refine_steps), "--device", args.device,
    ]  # fmt: skip
    print("layer by layer:", shlex.join(cmd), flush=True)
    res = {"layerwise": run_child(cmd), "budget": budget(config, args.calib_tokens), "config": config}
    if res["layerwise"]["exit_code"] == 0:
        prov = json.loads((dst / "gqakit.json").read_text())
        per_layer = prov["layerwise"]["seconds_per_layer"]
        quarter = max(1, len(per_layer) // 4)
        res["layerwise"].update(
            seconds_per_layer=per_layer,
            peak_device_bytes=prov["layerwise"].get("peak_device_bytes"),
            median_layer_s=statistics.median(per_layer),
            first_quarter_mean_s=statistics.mean(per_layer[:quarter]),
            last_quarter_mean_s=statistics.mean(per_layer[-quarter:]),
            refine=[
                {k: e[k] for k in ("layer", "heldout_before", "heldout_after")}
                for e in prov["refine"]["attention_error"]
            ]
            if "refine" in prov
            else None,
        )
    shutil.rmtree(dst, ignore_errors=True)

    b, lw = res["budget"], res["layerwise"]
    print(f"\n{shlex.join(sys.argv)}")
    print(f"model: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"{config['num_attention_heads']} heads, vocab {config['vocab_size']}")  # fmt: skip
    print(f"budget 3 x layer {gib(b['layer_f32'])} + embedding {gib(b['embedding_f32'])} + hidden states "
          f"{gib(b['hidden_states_f32'])} = {gib(b['budget'])}")  # fmt: skip
    ratio = lw["peak_rss_bytes"] / b["budget"]
    print(f"layer by layer: exit {lw['exit_code']}, peak RSS {gib(lw['peak_rss_bytes'])} "
          f"({ratio:.2f}x the budget), {lw['wall_s']:.0f} s")  # fmt: skip
    if lw["exit_code"] != 0:
        print(f"  the conversion failed:\n{lw['stderr_tail']}")
    if lw.get("peak_device_bytes"):
        print(f"  peak GPU memory (max allocated): {gib(lw['peak_device_bytes'])}")
    if "median_layer_s" in lw:
        print(f"  per layer: median {lw['median_layer_s']:.1f} s, "
              f"first quarter {lw['first_quarter_mean_s']:.1f} s, "
              f"last quarter {lw['last_quarter_mean_s']:.1f} s")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        res["command"] = shlex.join(sys.argv)
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
