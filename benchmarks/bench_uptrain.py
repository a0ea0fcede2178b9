"""Uptraining benchmark: our loop against Hugging Face ``Trainer``, and quality recovery lm vs distill.

1. Throughput: the same model, data, batch and sequence length trained by ``gqakit.uptrain`` and by
   ``transformers.Trainer``, each in its own process (so peak memory is its own), alternating
   ``--repeats`` times. A step's time is the wall time between the ends of consecutive optimizer steps
   (data, forward, backward, clipping, optimizer, logging: everything), median over the steps after
   ``--warmup``. Reported: tokens/s, the ratio ours / Trainer, peak memory (RSS on CPU, max allocated
   on a GPU) and, on a GPU, model FLOPs utilisation (6 x parameters x tokens/s over the device peak).
2. Quality recovery (``--quality``): SmolLM2-135M converted to MQA, uptrained for the same token
   budget with ``lm`` and with ``distill``; the fraction of the validation-loss gap (converted vs
   original) each closes, and the same in perplexity.

    python benchmarks/bench_uptrain.py                              # throughput, tiny-ish random llama
    python benchmarks/bench_uptrain.py --shape tinyllama-1.1b --seq-len 2048 --batch-size 8   # a GPU
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
    from gqakit.uptrain.recipe import DataConfig

    cfg = DataConfig(files=[args.train], seq_len=args.seq_len, val_fraction=0.01, max_val_blocks=4)
    return build_blocks(cfg, load_tokenizer(args.model))


def worker_ours(args) -> dict:
    import torch

    from gqakit.uptrain import recipe_from_dict, uptrain
    from gqakit.uptrain.loop import read_history

    precision = "bf16" if torch.cuda.is_available() else "fp32"
    recipe = recipe_from_dict(
        {
            "model": {"path": args.model},
            "data": {
                "files": [args.train],
                "seq_len": args.seq_len,
                "val_fraction": 0.01,
                "max_val_blocks": 4,
            },
            "budget": {"steps": args.steps},
            "train": {"lr": 1e-4, "batch_size": args.batch_size, "precision": precision},
            "eval": {"at_start": False},
            "log": {"progress": False, "tensorboard": False},
            "output_dir": args.out,
        }
    )
    uptrain(recipe, force=True)
    tps = args.batch_size * args.seq_len
    # avg_tokens_per_s is cumulative from the loop's start: recover each step's end time from it.
    ends = [h["step"] * tps / h["avg_tokens_per_s"] for h in read_history(args.out) if "loss" in h]
    return {"step_s": [b - a for a, b in zip(ends, ends[1:], strict=False)], "peak_mib": _peak_memory_mib()}


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


def _run_worker(kind: str, args, out: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--model",
        args.model,
        "--train",
        args.train,
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Random-weight llamas to train: "small" for a CPU; the others are real models' shapes, for a GPU
# (MFU is only meaningful when the matrices are big enough to fill it).
SHAPES = {
    "small": dict(heads=8, kv_heads=2, layers=4, hidden=256, vocab_size=8192, intermediate_size=768),
    "smollm2-135m": dict(
        heads=9, kv_heads=3, layers=30, hidden=576, head_dim=64, vocab_size=49152,
        intermediate_size=1536, tie_word_embeddings=True,
    ),
    "tinyllama-1.1b": dict(
        heads=32, kv_heads=4, layers=22, hidden=2048, head_dim=64, vocab_size=32000,
        intermediate_size=5632,
    ),
}  # fmt: skip


def _make_model(root: Path, shape: str, seq_len: int) -> str:
    from gqakit.testing import save_tiny_model

    path = save_tiny_model(
        root / "model", "llama", max_position_embeddings=max(seq_len, 256), **SHAPES[shape]
    )
    return str(path)


def _make_text(root: Path, text_dir: str | None) -> str:
    if text_dir and (Path(text_dir) / "train.txt").is_file():
        return str(Path(text_dir) / "train.txt")
    from gqakit.testing import TINY_TEXT

    path = root / "train.txt"
    sentences = [s for s in TINY_TEXT.split(". ") if s]
    path.write_text("\n".join(". ".join(sentences[i % 5 :] + sentences[: i % 5]) for i in range(2000)))
    return str(path)


def throughput(args) -> None:
    import torch

    with tempfile.TemporaryDirectory(prefix="bench-uptrain-") as tmp:
        root = Path(tmp)
        if not args.model:
            args.model = _make_model(root, args.shape, args.seq_len)
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):  # counts tied embeddings once
            config = AutoConfig.from_pretrained(args.model)
            n_params = AutoModelForCausalLM.from_config(config).num_parameters()
        args.train = _make_text(root, args.text_dir)
        runs: dict[str, list[dict]] = {"ours": [], "trainer": []}
        for r in range(args.repeats):
            for kind in ("ours", "trainer") if r % 2 == 0 else ("trainer", "ours"):
                runs[kind].append(_run_worker(kind, args, root / f"{kind}-{r}"))
    tokens = args.batch_size * args.seq_len
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores, {args.threads or torch.get_num_threads()} thread(s) per run)"
    )
    dtype = "bf16 autocast" if torch.cuda.is_available() else "fp32"
    print(
        f"\n## Throughput: {device}, {n_params / 1e6:.1f}M parameters, batch {args.batch_size} x seq "
        f"{args.seq_len} = {tokens} tokens/step, {dtype}, {args.steps} steps ({args.warmup} warm-up), "
        f"{args.repeats} runs each\n"
    )
    print(
        "| loop | tokens/s (median step) | step ms | peak memory MiB |"
        + (" MFU |" if torch.cuda.is_available() else "")
    )
    print("|---|---|---|---|" + ("---|" if torch.cuda.is_available() else ""))
    tps = {}
    for kind, results in runs.items():
        steps = [s for res in results for s in res["step_s"][args.warmup :]]
        med = statistics.median(steps)
        tps[kind] = tokens / med
        peak = max(res["peak_mib"] for res in results)
        mfu = ""
        if torch.cuda.is_available():
            mfu = f" {6 * n_params * tps[kind] / (args.peak_tflops * 1e12):.1%} |"
        name = "gqakit uptrain" if kind == "ours" else "transformers Trainer"
        print(f"| {name} | {tps[kind]:,.0f} | {med * 1e3:.1f} | {peak:,.0f} |{mfu}")
    print(f"\nratio ours / Trainer: **{tps['ours'] / tps['trainer']:.2f}x** tokens/s")


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
