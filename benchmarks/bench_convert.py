"""Conversion speed and memory: gqakit's streaming converter vs `cp -r` vs the naive in-memory path.

Builds a synthetic Llama-shaped, multi-shard bf16 safetensors checkpoint (no model is instantiated to
build it), then times, in one run and interleaved, each of:

- ``cp -r SRC DST`` (the floor: the bytes have to be written once anyway);
- ``gqakit convert SRC DST --groups G`` (streaming, tensor by tensor);
- naive: ``AutoModelForCausalLM.from_pretrained`` + pool the state dict + ``save_pretrained``.

Each runs in its own process, so its peak RSS (``ru_maxrss`` from ``wait4``) is its own. Reports the
median wall time, throughput as a ratio to ``cp``, and peak RSS as a ratio to the largest input shard.

    python benchmarks/bench_convert.py --workdir /tmp/gqakit-bench --size-gb 2.1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from gqakit.safetensors_io import save_state_dict

NAIVE = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from gqakit.convert import ADAPTERS, RegroupSpec, convert_state_dict
from gqakit.geometry import AttentionGeometry
src, dst, groups = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
geom = AttentionGeometry.from_config(model.config.to_dict())
sd = convert_state_dict(model.state_dict(), ADAPTERS["llama"], geom, RegroupSpec(groups))
model.config.num_key_value_heads = groups
for layer in model.model.layers:  # resize the modules so load_state_dict accepts the pooled tensors
    for name in ("k_proj", "v_proj"):
        old = getattr(layer.self_attn, name)
        setattr(layer.self_attn, name, torch.nn.Linear(old.in_features, groups * geom.head_dim, bias=False,
                                                       dtype=old.weight.dtype))
model.load_state_dict(sd)
model.save_pretrained(dst, max_shard_size="600MB")
"""


def build_checkpoint(path: Path, size_gb: float, shard_mb: int) -> dict:
    """A Llama-shaped bf16 checkpoint of about ``size_gb``, sharded like save_pretrained does."""
    hidden, heads, inter, vocab = 2048, 16, 5632, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, int((size_gb * 1e9 / 2 - 2 * vocab * hidden) / per_layer))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{n}.weight"] = (hidden, hidden)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)

    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if size and size + nbytes > shard_mb * 2**20:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in shard.items()}
        save_state_dict(tensors, path / fname)
        weight_map.update(dict.fromkeys(shard, fname))
        del tensors
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (path / "config.json").write_text(json.dumps(config))
    return {"layers": layers, "shards": len(shards), "bytes": total}


# Runs the command and prints its peak RSS. A tiny launcher, because a child forked straight from this
# process would inherit (and report) this process's own RSS in ru_maxrss.
LAUNCHER = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
)


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one command."""
    os.sync()  # no dirty pages left by the last run, so none is throttled for another's writes
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed: {proc.stderr[-2000:]}")
    return elapsed, int(proc.stdout.split()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-bench-convert"))
    ap.add_argument("--size-gb", type=float, default=2.1)
    ap.add_argument("--shard-mb", type=int, default=600)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--naive-repeats", type=int, default=1)
    args = ap.parse_args()

    src = args.workdir / "src"
    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    info = build_checkpoint(src, args.size_gb, args.shard_mb)
    largest = max(f.stat().st_size for f in src.glob("*.safetensors"))
    subprocess.run(f"cat {src}/* > /dev/null", shell=True, check=True)  # same (warm) page cache for all

    gq = [sys.executable, "-m", "gqakit.cli", "convert", str(src), None, "--groups", str(args.groups)]
    variants = {
        "cp -r": lambda dst: ["cp", "-r", str(src), str(dst)],
        "gqakit convert": lambda dst: [x if x is not None else str(dst) for x in gq],
        "naive (from_pretrained + save_pretrained)": lambda dst: [
            sys.executable,
            "-c",
            NAIVE,
            str(src),
            str(dst),
            str(args.groups),
        ],
    }
    results: dict[str, list[tuple[float, int]]] = {k: [] for k in variants}
    own: list[float] = []  # gqakit's conversion alone (its gqakit.json): the run minus Python/torch start-up
    for rep in range(args.repeats):
        order = list(variants.items())
        for name, make in order[rep % len(order) :] + order[: rep % len(order)]:  # rotate who goes first
            if name.startswith("naive") and rep >= args.naive_repeats:
                continue
            dst = args.workdir / f"out-{rep}-{len(results[name])}-{name.split()[0]}"
            results[name].append(run(make(dst)))
            if name == "gqakit convert":
                own.append(json.loads((dst / "gqakit.json").read_text())["elapsed_s"])
            shutil.rmtree(dst)

    cp_time = statistics.median(t for t, _ in results["cp -r"])
    ours = statistics.median(t for t, _ in results["gqakit convert"])
    gb = info["bytes"] / 1e9
    print(
        f"\nSynthetic Llama-shaped bf16 checkpoint: {gb:.2f} GB, {info['layers']} layers, "
        f"{info['shards']} shards, "
        f"largest shard {largest / 2**20:.0f} MiB; MHA-16 -> G={args.groups}; {os.cpu_count()} CPUs\n"
    )
    print("| path | wall s (median) | GB/s | speed vs cp | peak RSS MiB | RSS / largest shard |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        t = statistics.median(x for x, _ in runs)
        rss = max(r for _, r in runs)
        print(
            f"| {name} | {t:.2f} | {gb / t:.2f} | {cp_time / t:.2f}x | {rss / 2**20:.0f} "
            f"| {rss / largest:.2f} |"
        )
    alone = statistics.median(own)
    print(f"| gqakit's conversion alone (gqakit.json, no start-up) | {alone:.2f} | {gb / alone:.2f} | "
          f"{cp_time / alone:.2f}x | | |")  # fmt: skip
    naive = statistics.median(t for t, _ in results["naive (from_pretrained + save_pretrained)"])
    print(
        f"\ngqakit convert is {naive / ours:.1f}x faster than the naive path "
        f"(targets: >= 0.8x cp speed at 4 GB, RSS <= 0.5x the largest shard, >= 3x faster than naive)"
    )
    print(
        f"command: python benchmarks/bench_convert.py --size-gb {args.size_gb} --shard-mb {args.shard_mb} "
        f"--groups {args.groups} --repeats {args.repeats}"
    )
    shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
