"""Peak memory per process of a distillation run, one process against FSDP2 over N CPU processes.

SmolLM2-135M converted to MQA (``gqakit convert --groups 1``, done once, outside the measurement) is
distilled from the original for a few steps with ``gqakit uptrain recipes/smollm2-135m-mqa.yaml``: with
N = 1 as one plain process (student and teacher whole), with N > 1 through
``recipes/accelerate/fsdp-cpu.yaml`` (FSDP2 over N gloo processes: the student's parameters, gradients
and AdamW state and the teacher sharded). Each process records its RSS high-water mark
(``getrusage(RUSAGE_SELF).ru_maxrss``) three times: after the imports (torch, transformers, accelerate),
when the training loop ends (loading, sharding and every step included) and at exit (the final
evaluation and saving included: under FSDP the main process gathers the whole model to save it). The
per-process batch is the same for every N, so the activations per process are too.

    python benchmarks/bench_fsdp_memory.py --processes 1,2 --steps 3 --batch-size 2 --seq-len 128 \
        --json /tmp/fsdp_peaks.json

It prints each run's command and a table of the figures side by side (MiB), and writes them as JSON
with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "smollm2-135m-mqa.yaml"
CONFIG = ROOT / "recipes" / "accelerate" / "fsdp-cpu.yaml"


def _hwm_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(record: str, argv: list[str]) -> None:
    """One process of the run: ``gqakit uptrain ARGV`` with its high-water marks appended to ``record``."""
    import atexit
    import logging

    from gqakit.uptrain import train
    from gqakit.uptrain.cli import uptrain_cmd

    marks = {"rank": int(os.environ.get("RANK", 0)), "after_imports": _hwm_mib()}
    loop = train.train

    def train_then_mark(run):
        loop(run)
        marks["after_training"] = _hwm_mib()

    def write() -> None:
        marks["at_exit"] = _hwm_mib()
        with open(record, "a") as fh:
            fh.write(json.dumps(marks) + "\n")

    train.train = train_then_mark
    atexit.register(write)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    uptrain_cmd(argv, prog_name="bench_fsdp_memory.py", standalone_mode=False)


def run(n: int, student: Path, teacher: str, work: Path, args: argparse.Namespace) -> dict:
    record = work / f"marks-{n}.jsonl"
    overrides = [
        f"model.path={student}", "model.convert=null", f"teacher={teacher}", "budget.tokens=null",
        f"budget.steps={args.steps}", f"train.batch_size={args.batch_size}", f"data.seq_len={args.seq_len}",
        "data.max_val_blocks=4", "eval.every=0", "eval.at_start=false", "checkpoint.every=0",
        "log.progress=false", f"output_dir={work / f'run-{n}'}",
    ]  # fmt: skip
    entry = [str(Path(__file__).resolve()), "--child", str(record), str(RECIPE), *overrides, "--force"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if n == 1:
        cmd = [sys.executable, *entry]
    else:
        import yaml

        from gqakit.uptrain.cli import launch_env

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
            "--num_processes", str(n), "--main_process_port", str(port), *entry,
        ]  # fmt: skip
        env = {**launch_env(yaml.safe_load(CONFIG.read_text())), "OMP_NUM_THREADS": str(args.threads)}
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"N={n} failed:\n{proc.stderr[-4000:]}")
    sharded = [ln.split(": ", 1)[-1] for ln in proc.stderr.splitlines() if "sharded over" in ln]
    marks = sorted((json.loads(ln) for ln in record.read_text().splitlines()), key=lambda m: m["rank"])
    return {
        "processes": n,
        "command": " ".join(cmd),
        "wall_s": round(time.perf_counter() - start, 1),
        "teacher": sharded[0] if sharded else "whole in the process",
        "ranks": [{k: round(v, 1) if isinstance(v, float) else v for k, v in m.items()} for m in marks],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.add_argument("--model", default=os.path.expanduser("~/.cache/gqakit/smollm2-135m/model"))
    p.add_argument("--processes", default="1,2", help="comma-separated N to measure")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2, help="blocks per process per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process")
    p.add_argument("--json", help="write the figures here as JSON")
    args = p.parse_args()
    if args.child:
        return child(args.child[0], args.child[1:])
    import accelerate
    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix="bench-fsdp-mem-") as tmp:
        work = Path(tmp)
        student = work / "mqa"
        convert = ["gqakit", "convert", args.model, str(student), "--groups", "1", "--preset", "mean"]
        print("$ " + " ".join(convert), flush=True)
        subprocess.run([sys.executable, "-m", "gqakit.cli", *convert[1:]], check=True, capture_output=True)
        runs = [run(int(n), student, args.model, work, args) for n in args.processes.split(",")]
    result = {
        "what": f"distillation of SmolLM2-135M (MQA) from the original, {args.steps} steps, batch "
        f"{args.batch_size} x {args.seq_len} tokens per process, fp32, {args.threads} thread(s) per process",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}, Python {platform.python_version()}",
        "benchmark": "python benchmarks/bench_fsdp_memory.py " + " ".join(sys.argv[1:]),
        "runs": runs,
    }
    print(f"\n{result['what']}\n{result['machine']}\n{result['versions']}\n")
    print("RSS high-water mark per process, MiB")
    print(f"{'N':>2} {'rank':>4} {'after imports':>14} {'end of training':>16} {'at exit':>8}")
    for r in runs:
        for m in r["ranks"]:
            row = f"{r['processes']:>2} {m['rank']:>4} {m['after_imports']:>14,.0f}"
            print(f"{row} {m.get('after_training', float('nan')):>16,.0f} {m['at_exit']:>8,.0f}")
        print(f"   teacher: {r['teacher']}; {r['wall_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
