"""lm-eval tasks through vLLM: ``gqakit eval --engine vllm --tasks NAMES``.

The tasks run in vLLM's Python (:mod:`gqakit.eval.vllm_lm_eval`) with lm-eval's own ``vllm`` model type,
on the checkpoint directory as it is, with our task directory registered as for ``--engine hf``. That
Python needs lm-eval beside vLLM (``pip install "lm-eval>=0.4.10"`` into it; the message says so).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import gqakit.text as gqakit_text
from gqakit.errors import GqakitError
from gqakit.eval.lm_eval_bridge import OUR_TASKS, TASKS_DIR, LmEvalArgs, check_tasks, split_tasks

_SCRIPT = Path(__file__).with_name("vllm_lm_eval.py")
# What our tasks' data loader (tasks/local_data.py) imports from gqakit: linked into a bare package on
# vLLM's PYTHONPATH, so that Python never sees gqakit's own dependencies (its transformers differs).
_SHIM_MODULES = ("text.py", "errors.py")


def _shim(root: Path) -> Path:
    package = root / "gqakit"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    here = Path(gqakit_text.__file__).resolve().parent
    for name in _SHIM_MODULES:
        (package / name).symlink_to(here / name)
    return root


def run_vllm_lm_eval(
    python: str,
    path: str,
    tasks: list[str] | tuple[str, ...] | str,
    *,
    args: LmEvalArgs,
    dtype: str,
    max_length: int,
    seed: int,
    batch_size: int,
    kv_budget_gib: int | None,
    gpu_memory_utilization: float | None = None,
) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on ``path`` with lm-eval's vLLM model in ``python``; return its results.

    Args:
        python: the interpreter that imports vLLM and lm-eval.
        path: the checkpoint directory.
        tasks: lm-eval task names (checked here first, with did-you-mean).
        args: ``--lm-eval-args``, parsed; ``max_length`` and the like go to lm-eval's ``VLLM``.
        dtype: the compute dtype (``float32``...).
        max_length: the rolling window of perplexity tasks (``--seq-len``).
        seed: lm-eval's and vLLM's seeds.
        batch_size: lm-eval's batch size.
        kv_budget_gib: vLLM's KV-cache memory on a CPU (``VLLM_CPU_KVCACHE_SPACE``); None on a GPU.
        gpu_memory_utilization: vLLM's share of GPU memory; None on a CPU.

    Returns:
        ``{"results": {task: {metric: value}}, ...}``, as :func:`gqakit.eval.lm_eval_bridge.run_lm_eval`.

    Raises:
        GqakitError: unknown tasks, lm-eval missing from that Python, or lm-eval's failure (its last line).
    """
    tasks = split_tasks(tasks)
    check_tasks(tasks, args)
    model_args: dict[str, Any] = {
        "pretrained": path, "dtype": dtype, "max_length": max_length,
        "seed": seed, "batch_size": batch_size, **args.hflm,
    }  # fmt: skip
    if gpu_memory_utilization is not None:
        model_args["gpu_memory_utilization"] = gpu_memory_utilization
    settings = {
        "model_args": model_args,
        "tasks": list(tasks),
        "include_path": [str(TASKS_DIR), *args.include_path],
        "include_defaults": bool(args.include_path) or any(t not in OUR_TASKS for t in tasks),
        "metadata": args.metadata,
        "evaluate": args.evaluate,
        "seed": seed,
    }
    with tempfile.TemporaryDirectory(prefix="gqakit-vllm-lm-eval-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(_shim(Path(tmp)))}
        if kv_budget_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_budget_gib)
        proc = subprocess.run(
            [python, str(_SCRIPT), json.dumps(settings)], env=env, capture_output=True, text=True, check=False
        )
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        if "No module named 'lm_eval'" in proc.stderr:
            raise GqakitError(
                f"--tasks with --engine vllm runs lm-eval in vLLM's Python ({python}), which has no lm-eval: "
                f'{python} -m pip install "lm-eval>=0.4.10"'
            )
        raise GqakitError(f"lm-eval in vLLM could not run {', '.join(tasks)}: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


__all__ = ["run_vllm_lm_eval"]
