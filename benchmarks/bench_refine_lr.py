"""Refinement learning rates side by side: held-out attention-output error per layer after N Adam steps.

Layer-wise refinement (``gqakit convert --refine-steps``) fits each converted attention block to the
original's output. This benchmark runs the package's own fit (``refine.fit_block``) on a few layers of a
converted checkpoint with several learning rates, on the same calibration batches and held-out split as
``convert`` uses, and prints each layer's held-out error (the figure refinement keeps its best step by) as
a ratio to the first learning rate's. It chose ``--refine-lr``'s default. It needs no GPU: about 30 s per
layer and rate for 400 steps of SmolLM2-135M on 2 CPU cores.

    gqakit convert $C/smollm2-135m/model /tmp/mqa-cal --groups 1 --method calibrated \\
        --calib-data $C/wiki-en/train.txt
    python benchmarks/bench_refine_lr.py --model $C/smollm2-135m/model --start /tmp/mqa-cal \\
        --calib-data $C/wiki-en/train.txt --calib-tokens 16384 --steps 400 --lrs 3e-4,1e-3 \\
        --layers 0,10,20,29 --out benchmarks/results/refine-lr.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the original checkpoint")
    ap.add_argument(
        "--start", required=True, help="a converted checkpoint (the merge refinement starts from)"
    )
    ap.add_argument("--calib-data", required=True)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lrs", default="3e-4,1e-3")
    ap.add_argument("--layers", default="0,10,20,29")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the figures as JSON here too")
    args = ap.parse_args()

    from transformers import AutoConfig

    from gqakit.checkpoint import resolve_checkpoint
    from gqakit.convert.calibrate import calibration_sequences
    from gqakit.convert.decoder_stream import DecoderStream
    from gqakit.convert.layerwise import LayerCapture
    from gqakit.convert.refine import RefineSettings, converted_attention, fit_block, split_batches
    from gqakit.convert.registry import get_adapter

    torch.manual_seed(args.seed)
    lrs = [float(x) for x in args.lrs.split(",")]
    layers = sorted({int(x) for x in args.layers.split(",")})
    start = {}
    for shard in sorted(Path(args.start).glob("*.safetensors")):
        start.update(load_file(shard))
    config = AutoConfig.from_pretrained(args.model)
    config.num_key_value_heads = json.loads((Path(args.start) / "config.json").read_text())[
        "num_key_value_heads"
    ]
    adapter = get_adapter(config.model_type)
    rows = []
    with resolve_checkpoint(args.model) as ckpt, ckpt.reader() as reader:
        # the same sequences and batches as convert refines on, and its layer-by-layer run of the original
        fit_runs, check_runs = split_batches(calibration_sequences(ckpt, args.calib_data, args.calib_tokens))
        stream = DecoderStream(ckpt, reader, adapter, fit_runs + check_runs, torch.device("cpu"))
        hidden = stream.hidden
        for layer in range(max(layers) + 1):
            with stream.layer(layer) as module:
                cap = LayerCapture(module, "", stream.attention_name, gram=False, io=True)
                hidden = stream.run(layer, module, hidden)
                cap.remove()
            stream.release(layer)
            if layer not in layers:
                continue
            fit, check = cap.io[: len(fit_runs)], cap.io[len(fit_runs) :]
            path = adapter.attention_module(layer)
            original = stream.layers[layer].get_submodule(stream.attention_name)
            for lr in lrs:
                module = converted_attention(original, config, layer, torch.device("cpu"))
                with torch.no_grad():
                    for name, p in module.named_parameters():
                        p.copy_(start[f"{path}.{name}"])
                t = time.perf_counter()
                res = fit_block(module, fit, check, RefineSettings(args.steps, lr, args.seed))
                rows.append({"layer": layer, "lr": lr, **res, "seconds": round(time.perf_counter() - t, 1)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    base = {r["layer"]: r["heldout_after"] for r in rows if r["lr"] == lrs[0]}
    print(f"command: python {shlex.join(sys.argv)}")
    fitted, heldout = sum(b.numel() for b in fit_runs), sum(b.numel() for b in check_runs)
    print(
        f"held-out attention-output error after {args.steps} steps ({fitted} fitted, {heldout} held-out "
        f"tokens); ratio to lr {lrs[0]:g}"
    )
    print("| layer | lr | before | after (fit) | held-out before | held-out after | ratio | best step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["heldout_after"] / base[r["layer"]]
        print(
            f"| {r['layer']} | {r['lr']:g} | {r['before']:.4f} | {r['after']:.4f} "
            f"| {r['heldout_before']:.4f} | {r['heldout_after']:.4f} | {ratio:.3f} | {r['best_step']} |"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"command": shlex.join(sys.argv), "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
