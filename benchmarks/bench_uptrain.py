"""Uptraining benchmark: the loop's speed levers side by side, HF ``Trainer``, and quality lm vs distill.

1. Throughput: the same model, data, batch and sequence length trained by ``gqakit.uptrain`` under each
   row's ``speed:`` settings (``--rows``; ``plain`` is the loop with every lever off, ``auto`` the
   defaults) and by ``transformers.Trainer``, each run in its own process (so peak memory is its own),
   rows interleaved ``--repeats`` times. A step's time is the wall time between the ends of consecutive
   optimizer steps (data, forward, backward, clipping, optimizer, logging: everything), median over the
   steps after ``--warmup`` (compilation happens in the warm-up). Reported: tokens/s, each row's ratio
   to ``plain``, peak memory (RSS on CPU, max allocated on a GPU), the largest relative difference of
   its per-step losses from ``plain``'s (same data, same seed), and on a GPU the model FLOPs
   utilisation twice: 6 x parameters per token (attention not counted), and with attention counted as
   in PaLM (Chowdhery et al. 2022, app. B: 6N + 12 x layers x heads x head_dim x seq per token), both
   over ``--peak-tflops``. A row ending in ``:distill`` trains with the distillation objective against
   a second random model of the same shape as teacher (its forward pass counted as 2N + 4 x layers x
   heads x head_dim x seq per token).
2. Quality recovery (``--quality``): SmolLM2-135M converted to MQA, uptrained for the same token
   budget with ``lm`` and with ``distill``; the fraction of the validation-loss gap (converted vs
   original) each closes, and the same in perplexity.

    python benchmarks/bench_uptrain.py                              # CPU: plain vs auto, small llama
    python benchmarks/bench_uptrain.py --shape tinyllama-1.1b --seq-len 2048 --batch-size 4 --threads 0 \
        --rows plain,fused-loss,compile,auto,trainer,plain:distill,auto:distill  # GPU
    python benchmarks/bench_uptrain.py --quality --smol /tmp/assets/smol_st --text-dir WIKI_DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A sibling file: the script's folder is on sys.path when run as `python benchmarks/bench_uptrain.py`.
from uptrain_shapes import SHAPES, flops_per_token, make_model, make_text

# H100 SXM dense bf16 peak, for MFU; other GPUs: pass --peak-tflops.
DEFAULT_PEAK_TFLOPS = 989.0


def _peak_memory_mib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _blocks(args):
    from gqakit.models import load_tokenizer
    from gqakit.uptrain.data import build_blocks
    from gqakit.uptrain.recipe_schema import DataConfig

    cfg = DataConfig(files=[args.train], seq_len=args.seq_len, val_fraction=0.01, max_val_blocks=4)
    return build_blocks(cfg, load_tokenizer(args.model))


# Rows of the throughput table: the recipe's ``speed:`` section for each (unset keys: the defaults).
ROWS: dict[str, dict] = {
    "plain": {"fused_loss": False, "compile": False},  # every lever off
    "fused-loss": {"fused_loss": True, "compile": False},
    "compile": {"fused_loss": True, "compile": True},
    "auto": {},
}


def worker_ours(args) -> dict:
    import torch

    from gqakit.uptrain import recipe_from_dict, uptrain
    from gqakit.uptrain.checkpoints import read_history

    precision = "bf16" if torch.cuda.is_available() else "fp32"
    distill = args.objective == "distill"
    recipe = recipe_from_dict(
        {
            "model": {"path": args.model},
            "teacher": args.teacher if distill else None,
            "data": {
                "files": [args.train],
                "seq_len": args.seq_len,
                "val_fraction": 0.01,
                "max_val_blocks": 4,
            },
            "budget": {"steps": args.steps},
            "train": {"lr": 1e-4, "batch_size": args.batch_size, "precision": precision},
            "speed": json.loads(args.speed),
            "objective": {"kind": args.objective},
            "eval": {"at_start": False},
            "log": {"progress": False},
            "output_dir": args.out,
        }
    )
    uptrain(recipe, force=True)
    tps = args.batch_size * args.seq_len
    history = [h for h in read_history(args.out) if "loss" in h]
    # avg_tokens_per_s is cumulative from the loop's start: recover each step's end time from it.
    ends = [h["step"] * tps / h["avg_tokens_per_s"] for h in history]
    return {
        "step_s": [b - a for a, b in zip(ends, ends[1:], strict=False)],
        "peak_mib": _peak_memory_mib(),
        "losses": [h["loss"] for h in history],
    }


def worker_trainer(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    blocks = _blocks(args)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    def collate(rows):
        ids = torch.stack([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids}

    targs = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
        warmup_steps=0,  # ours: int(0.02 * steps) = 0 too
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        bf16=torch.cuda.is_available(),
        logging_steps=10**9,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_drop_last=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),
    )
    Trainer(
        model=model, args=targs, train_dataset=blocks.train, data_collator=collate, callbacks=[Clock()]
    ).train()
    return {"step_s": [b - a for a, b in zip(ends, ends[1:], strict=False)], "peak_mib": _peak_memory_mib()}


def _run_worker(row: str, args, out: Path) -> dict:
    name, _, objective = row.partition(":")
    kind = "trainer" if name == "trainer" else "ours"
    cmd = [sys.executable, __file__, "--worker", kind, "--model", args.model, "--train", args.train]
    cmd += ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    cmd += ["--out", str(out), "--objective", objective or "lm", "--teacher", args.teacher or ""]
    cmd += ["--speed", json.dumps(ROWS.get(name, {}))]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def throughput(args) -> None:
    import torch

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r.partition(":")[0] not in (*ROWS, "trainer")]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join([*ROWS, 'trainer'])} (suffix :distill)")
    with tempfile.TemporaryDirectory(prefix="bench-uptrain-") as tmp:
        root = Path(tmp)
        if not args.model:
            args.model = make_model(root / "model", args.shape, args.seq_len, seed=0)
        if any(r.endswith(":distill") for r in rows) and not args.teacher:
            args.teacher = make_model(root / "teacher", args.shape, args.seq_len, seed=1)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.model)
        with torch.device("meta"):  # counts tied embeddings once
            n_params = AutoModelForCausalLM.from_config(config).num_parameters()
        args.train = make_text(root, args.text_dir)
        runs: dict[str, list[dict]] = {r: [] for r in rows}
        for rep in range(args.repeats):
            for row in rows if rep % 2 == 0 else rows[::-1]:
                out = root / f"run-{len(runs[row])}-{row.replace(':', '-')}"
                runs[row].append(_run_worker(row, args, out))
                res = runs[row][-1]
                got = (
                    f"median step {statistics.median(res['step_s'][args.warmup :]) * 1e3:.1f} ms"
                    if "step_s" in res
                    else "failed: " + res["error"].strip().splitlines()[-1][:300]
                )
                print(f"ran {row} ({rep + 1}/{args.repeats}): {got}", flush=True)
    tokens = args.batch_size * args.seq_len
    cuda = torch.cuda.is_available()
    device = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        if cuda
        else f"CPU ({os.cpu_count()} cores, {args.threads or torch.get_num_threads()} thread(s) per run), "
        f"torch {torch.__version__}"
    )
    import transformers

    print(f"\n{' '.join(sys.argv)}")
    print(
        f"\n## Throughput: {device}, transformers {transformers.__version__}, {n_params / 1e6:.1f}M "
        f"parameters, batch {args.batch_size} x seq {args.seq_len} = {tokens} tokens/step, "
        f"{'bf16 autocast' if cuda else 'fp32'}, {args.steps} steps ({args.warmup} warm-up), "
        f"{args.repeats} run(s) each\n"
    )
    head = "| loop | tokens/s (median step) | vs plain | step ms | peak memory MiB | loss vs plain |"
    print(head + (" MFU (6N) | MFU (with attention) |" if cuda else ""))
    print("|---" * (8 if cuda else 6) + "|")
    # every row's median first: a row's "plain" baseline may run after it (--rows auto:distill,plain:distill)
    medians = {
        row: statistics.median([x for res in results for x in res["step_s"][args.warmup :]])
        for row, results in runs.items()
        if not any("error" in r for r in results)
    }
    tps = {row: tokens / med for row, med in medians.items()}
    for row, results in runs.items():
        if row not in medians:
            failed = next(r["error"] for r in results if "error" in r)
            print(f"| {row} | failed: {failed.strip().splitlines()[-1][:200]} |")
            continue
        med = medians[row]
        _, _, objective = row.partition(":")
        base = tps.get(f"plain:{objective}" if objective else "plain")
        ratio = f"{tps[row] / base:.2f}x" if base else ""
        ref = runs.get(f"plain:{objective}" if objective else "plain")
        loss_diff = ""
        if ref and "losses" in results[0] and "losses" in ref[0] and row.partition(":")[0] != "plain":
            a, b = results[0]["losses"], ref[0]["losses"]
            loss_diff = f"{max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=False)):.1e}"
        peak = max(res["peak_mib"] for res in results)
        line = f"| {row} | {tps[row]:,.0f} | {ratio} | {med * 1e3:.1f} | {peak:,.0f} | {loss_diff} |"
        if cuda:
            six_n, palm = flops_per_token(config, args.seq_len, n_params, objective == "distill")
            peak_flops = args.peak_tflops * 1e12
            line += f" {six_n * tps[row] / peak_flops:.1%} | {palm * tps[row] / peak_flops:.1%} |"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1))


def quality(args) -> None:
    import torch

    from gqakit.models import load_causal_lm, load_tokenizer
    from gqakit.uptrain import load_recipe, uptrain
    from gqakit.uptrain.data import build_blocks
    from gqakit.uptrain.objectives import lm_loss_per_sequence

    text = Path(args.text_dir)
    root = Path(args.quality_out)
    base = [
        f"model.path={args.smol}",
        f"teacher={args.smol}",
        f"data.files=[{text / 'train.txt'}]",
        f"data.val_files=[{text / 'validation.txt'}]",
        f"data.seq_len={args.q_seq_len}",
        f"data.max_val_blocks={args.q_val_blocks}",
        "budget.tokens=null",
        f"budget.steps={args.q_steps}",
        f"train.batch_size={args.q_batch_size}",
        "eval.every=0",
        "checkpoint.every=0",
        "log.progress=false",
    ]
    recipe_path = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m-mqa.yaml"
    results = {}
    for kind in ("lm", "distill"):
        r = load_recipe(recipe_path, [*base, f"objective.kind={kind}", f"output_dir={root / kind}"])
        t0 = time.perf_counter()
        res = uptrain(r, force=True)
        results[kind] = (res, time.perf_counter() - t0)
        r_for_val = r
    # The original model on the same validation blocks.
    blocks = build_blocks(r_for_val.data, load_tokenizer(args.smol))
    model = load_causal_lm(args.smol, dtype="float32", device="cpu")
    with torch.no_grad():
        losses = [
            lm_loss_per_sequence(model(input_ids=b[None]).logits, b[None]) for b in blocks.val["input_ids"]
        ]
    orig_loss = torch.cat(losses).mean().item()
    conv_loss = math.log(results["lm"][0].initial_val_ppl)
    tokens = results["lm"][0].tokens
    print(
        f"\n## Quality recovery: SmolLM2-135M GQA-3 -> MQA (mean), {tokens:,} training tokens "
        f"({args.q_steps} steps x {args.q_batch_size} x {args.q_seq_len}), fp32 CPU, "
        f"{len(blocks.val)} validation blocks ({len(blocks.val) * args.q_seq_len:,} tokens)\n"
    )
    print("| model | val loss | val ppl | loss gap closed | ppl gap closed | wall s |")
    print("|---|---|---|---|---|---|")
    print(f"| original (GQA-3) | {orig_loss:.4f} | {math.exp(orig_loss):.2f} | | | |")
    print(f"| converted (MQA), no training | {conv_loss:.4f} | {math.exp(conv_loss):.2f} | 0% | 0% | |")
    for kind, (res, wall) in results.items():
        loss = math.log(res.final_val_ppl)
        closed = (conv_loss - loss) / (conv_loss - orig_loss)
        closed_ppl = (math.exp(conv_loss) - res.final_val_ppl) / (math.exp(conv_loss) - math.exp(orig_loss))
        print(
            f"| MQA + uptrain `{kind}` | {loss:.4f} | {res.final_val_ppl:.2f} | {closed:.1%} "
            f"| {closed_ppl:.1%} | {wall:.0f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["ours", "trainer"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument(
        "--model", help="checkpoint for the throughput run (default: a random 4-layer llama, hidden 256)"
    )
    p.add_argument("--train", help=argparse.SUPPRESS)
    p.add_argument("--text-dir", help="a directory with train.txt / validation.txt (e.g. the wiki-en asset)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small", help="the random model to train")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--rows", default="plain,auto,trainer", help="rows, comma-separated (ROWS; :distill suffix)"
    )
    p.add_argument("--objective", default="lm", help=argparse.SUPPRESS)
    p.add_argument("--teacher", default="", help="teacher for :distill rows (default: a random model)")
    p.add_argument("--speed", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write every run's step times and losses here")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per worker (0: torch's default)")
    p.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS)
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--quality", action="store_true", help="also run the SmolLM2 quality-recovery comparison")
    p.add_argument("--smol", default=os.path.expanduser("~/.cache/gqakit/smollm2-135m/model"))
    p.add_argument("--quality-out", default="runs/bench-quality")
    p.add_argument("--q-steps", type=int, default=8)
    p.add_argument("--q-batch-size", type=int, default=4)
    p.add_argument("--q-seq-len", type=int, default=128)
    p.add_argument("--q-val-blocks", type=int, default=32)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker:
        fn = worker_ours if args.worker == "ours" else worker_trainer
        print(json.dumps(fn(args)))
        return
    if not args.no_throughput:
        throughput(args)
    if args.quality:
        quality(args)


if __name__ == "__main__":
    main()
