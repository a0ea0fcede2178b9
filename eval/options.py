"""The options of ``gqakit eval``: one frozen dataclass, checked once, every problem reported together."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from gqakit.cli_options import Problems, device_problem
from gqakit.errors import GqakitError
from gqakit.eval.decode import parse_grid
from gqakit.eval.engines import ENGINES, TASK_ENGINES
from gqakit.eval.lm_eval_bridge import parse_lm_eval_args, split_tasks
from gqakit.gguf.tensors import OUT_TYPES
from gqakit.models import DTYPES, resolve_device

DEFAULT_BATCH_SIZES = (1, 8, 32)
# The default context grid; points a model has no positions for are dropped (an explicit --contexts
# beyond the model's positions is an error instead).
DEFAULT_CONTEXTS = (256, 1024, 4096)


@dataclass(frozen=True)
class EvalOptions:
    """What ``gqakit eval`` measures and how. Grids and task lists also accept their CLI strings.

    Attributes:
        ppl_data: text for perplexity: ``.txt`` / ``.jsonl`` / ``.parquet`` file or hub dataset; None: skip.
        text_field: the text column of a table or hub dataset.
        split: hub dataset split.
        data_config: hub dataset configuration (``wikitext-2-raw-v1``).
        seq_len: tokens per perplexity window; also lm-eval's ``max_length``.
        stride: tokens scored per window after the first; None = seq_len (disjoint windows).
        batch_size: perplexity windows per forward pass; also lm-eval's batch size.
        max_tokens: score at most this many tokens of ``ppl_data``.
        bench: run the decode grid.
        batch_sizes: decode batch sizes.
        contexts: decode prompt lengths; None = 256, 1024, 4096, less those beyond a model's positions.
        new_tokens: tokens generated per decode point.
        warmup: untimed runs before each decode point.
        static_cache: decode with a static KV cache.
        compile: ``torch.compile`` the decode step (implies static_cache).
        tasks: lm-eval task names (ours: ``gqakit_ppl``, ``gqakit_mc``).
        lm_eval_args: more lm-eval options, ``"--num_fewshot 5 --limit 100"``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:1``...
        dtype: ``auto`` (the checkpoint's), ``float32``, ``bfloat16``, ``float16``.
        seed: seed for prompts, lm-eval and torch.
        progress: show progress bars.
        command_line: the command that ran, for results.json (default: ``sys.argv``).
        engine: one of :data:`gqakit.eval.engines.ENGINES`: ``hf`` (transformers, in this process) or
            ``llamacpp`` (llama.cpp through its Python binding, on a GGUF export of each model; decode at
            batch 1).
        vllm_python: the Python with vLLM for ``vllm`` (default ``$GQAKIT_VLLM_PYTHON``, else this one).
        kv_budget: the vLLM engine's KV-cache memory on a CPU, whole GiB (``VLLM_CPU_KVCACHE_SPACE``).
        gpu_memory_utilization: the vLLM engine's share of GPU memory (weights + KV cache); None: 0.9.
        rounds: the vLLM engine's throughput rounds per point (median and spread).
        gguf_type: the llama.cpp engine's weight type, ``f32`` (with a float32 KV cache: the same
            function as transformers in float32), ``f16`` or ``q8_0`` (with llama.cpp's f16 KV cache).
    """

    ppl_data: str | None = None
    text_field: str = "text"
    split: str = "test"
    data_config: str | None = None
    seq_len: int = 512
    stride: int | None = None
    batch_size: int = 8
    max_tokens: int | None = None
    bench: bool = False
    batch_sizes: tuple[int, ...] | str = DEFAULT_BATCH_SIZES
    contexts: tuple[int, ...] | str | None = None
    new_tokens: int = 32
    warmup: int = 1
    static_cache: bool = False
    compile: bool = False
    tasks: tuple[str, ...] | str = ()
    lm_eval_args: str = ""
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    progress: bool = True
    command_line: str | None = None
    engine: str = "hf"
    gguf_type: str = "f16"
    vllm_python: str | None = None
    kv_budget: int = 1
    gpu_memory_utilization: float | None = None
    rounds: int = 3

    def __post_init__(self) -> None:
        p = Problems("eval")
        f = p.flag
        for name in ("batch_sizes", "contexts"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                object.__setattr__(self, name, parse_grid(value, f(name)))
            except GqakitError as e:
                p.add(e.message)
        object.__setattr__(self, "tasks", split_tasks(self.tasks))
        for name in ("seq_len", "batch_size", "new_tokens", "rounds"):
            if getattr(self, name) < 1:
                p.add(f"{f(name)} must be positive, got {getattr(self, name)}.")
        if self.new_tokens == 1:
            p.add(f"{f('new_tokens')} must be at least 2 (one prefill token and one decode step).")
        if self.stride is not None and not 1 <= self.stride <= self.seq_len:
            p.add(f"{f('stride')} must be between 1 and {f('seq_len')} {self.seq_len}, got {self.stride}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            p.add(f"{f('max_tokens')} must be positive, got {self.max_tokens}.")
        if not isinstance(self.kv_budget, int) or self.kv_budget < 1:  # vLLM reads whole GiB
            p.add(f"{f('kv_budget')} must be a whole number of GiB, at least 1, got {self.kv_budget}.")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            p.add(f"{f('gpu_memory_utilization')} must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.warmup < 0:
            p.add(f"{f('warmup')} must be >= 0, got {self.warmup}.")
        if self.dtype not in DTYPES:
            p.add(f"{f('dtype')} {self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}.")
        device = device_problem(self.device, f("device"))
        p.add(device)
        try:
            if device is None:  # a device named right may still be absent (cuda on a CPU machine)
                resolve_device(self.device)
        except (GqakitError, RuntimeError) as e:
            p.add(e.message if isinstance(e, GqakitError) else f"{f('device')} {self.device!r}: {e}")
        try:
            parse_lm_eval_args(self.lm_eval_args, f("lm_eval_args"))
        except GqakitError as e:
            p.add(e.message)
        p.add(ENGINES.unknown(self.engine, f("engine")))
        if self.gguf_type not in OUT_TYPES:
            p.add(f"{f('gguf_type')} {self.gguf_type!r} is unknown; choose {', '.join(OUT_TYPES)}.")
        if self.engine in ENGINES and not ENGINES[self.engine].tasks and self.tasks:
            p.add(
                f"{f('tasks')} runs lm-eval on transformers: use {f('engine')} {' or '.join(TASK_ENGINES)} "
                "for tasks."
            )
        if not (self.ppl_data or self.bench or self.tasks):
            p.add(f"Nothing to evaluate: pass {f('ppl_data')} FILE, {f('bench')} and/or {f('tasks')} NAMES.")
        p.raise_if_any()

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


__all__ = ["DEFAULT_BATCH_SIZES", "DEFAULT_CONTEXTS", "EvalOptions"]
