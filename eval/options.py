"""The options of ``gqakit eval``: one frozen dataclass, checked once, every problem reported together."""

from __future__ import annotations

from dataclasses import dataclass

from gqakit.cli_options import device_field, opt, parse_list, progress_field
from gqakit.dtypes import LOAD_DTYPES
from gqakit.errors import GqakitError
from gqakit.eval.decode import parse_grid
from gqakit.eval.engines import ENGINES
from gqakit.eval.lm_eval_bridge import parse_lm_eval_args
from gqakit.gguf.export import OUT_TYPES
from gqakit.models import resolve_device
from gqakit.problems import Problems, device_problem

DEFAULT_BATCH_SIZES = (1, 8, 32)
# The default context grid; points a model has no positions for are dropped (an explicit --contexts
# beyond the model's positions is an error instead).
DEFAULT_CONTEXTS = (256, 1024, 4096)


@dataclass(frozen=True)
class EvalOptions:
    """What ``gqakit eval`` measures and how. Grids and task lists also accept their CLI strings."""

    ppl_data: str | None = opt(None, "Text for perplexity: .txt, .jsonl, .parquet or a hub dataset.")
    seq_len: int = opt(512, "Tokens per perplexity window (also lm-eval's max_length).")
    max_tokens: int | None = opt(None, "Score at most this many tokens of --ppl-data.")
    batch_size: int = opt(8, "Perplexity windows per forward pass (also lm-eval's batch size).")
    bench: bool = opt(False, "Measure decode speed and KV-cache memory over the grid.")
    batch_sizes: tuple[int, ...] | str = opt(DEFAULT_BATCH_SIZES, "Decode batch sizes.", kind=int)
    contexts: tuple[int, ...] | str | None = opt(
        None, "Decode prompt lengths [default: 256,1024,4096 within the model's positions].", kind=int
    )
    new_tokens: int = opt(32, "Tokens generated per decode point.")
    tasks: tuple[str, ...] | str = opt((), "lm-eval tasks (offline ones: gqakit_ppl, gqakit_mc).", kind=str)
    lm_eval_args: str = opt("", 'More lm-eval options, e.g. "--num_fewshot 5 --limit 100".')
    engine: str = opt("hf", ENGINES.describe() + ".", choices=ENGINES.names)
    device: str = device_field()
    dtype: str = opt("auto", "Compute dtype; auto: the checkpoint's.", choices=LOAD_DTYPES)
    seed: int = opt(0, "Seed for prompts, lm-eval and torch.")
    progress: bool = progress_field()
    # the knobs, given as --set name=value
    text_field: str = opt("text", "the text column of a table or hub dataset", cli="set")
    split: str = opt("test", "the split of a hub dataset", cli="set")
    data_config: str | None = opt(None, "the configuration of a hub dataset (wikitext-2-raw-v1)", cli="set")
    stride: int | None = opt(None, "tokens scored per perplexity window after the first [seq_len]", cli="set")
    warmup: int = opt(1, "untimed decode runs before each point", cli="set")
    static_cache: bool = opt(False, "decode with a static KV cache", cli="set")
    gguf_type: str = opt("f16", "llamacpp's weights; f32 also keeps its KV cache in float32", cli="set")
    vllm_python: str | None = opt(None, "the Python with vLLM [$GQAKIT_VLLM_PYTHON, else this]", cli="set")
    kv_budget: int = opt(1, "vllm's KV-cache memory on a CPU, whole GiB (VLLM_CPU_KVCACHE_SPACE)", cli="set")
    gpu_memory_utilization: float | None = opt(None, "vllm's GPU memory share, weights + KV [0.9]", cli="set")
    rounds: int = opt(3, "vllm's throughput rounds per decode point", cli="set")
    command_line: str | None = None  # the command that ran, for results.json (default: sys.argv)

    def __post_init__(self) -> None:
        p = Problems("eval")
        f = p.flag  # a knob is named "--set name" where the running command has --set

        for name in [n for n in ("batch_sizes", "contexts") if getattr(self, n) is not None]:
            try:
                object.__setattr__(self, name, parse_grid(getattr(self, name), f(name)))
            except GqakitError as e:
                p.add(e.message)
        object.__setattr__(self, "tasks", parse_list(self.tasks or (), str, "--tasks"))
        least = {"seq_len": 1, "batch_size": 1, "new_tokens": 2, "rounds": 1, "max_tokens": 1, "warmup": 0}
        for name, low in least.items():
            if getattr(self, name) is not None and getattr(self, name) < low:
                why = " (one prefill token and one decode step)" if name == "new_tokens" else ""
                p.add(f"{f(name)} must be at least {low}{why}, got {getattr(self, name)}.")
        if self.stride is not None and not 1 <= self.stride <= self.seq_len:
            p.add(f"{f('stride')} must be between 1 and {f('seq_len')} {self.seq_len}, got {self.stride}.")
        if not isinstance(self.kv_budget, int) or self.kv_budget < 1:  # vLLM reads whole GiB
            p.add(f"{f('kv_budget')} must be a whole number of GiB, at least 1, got {self.kv_budget}.")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            p.add(f"{f('gpu_memory_utilization')} must be in (0, 1], got {self.gpu_memory_utilization}.")
        for name, known in (("dtype", LOAD_DTYPES), ("gguf_type", OUT_TYPES)):
            if getattr(self, name) not in known:
                p.add(f"{f(name)} {getattr(self, name)!r} is unknown; choose one of {', '.join(known)}.")
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
        if self.engine in ENGINES and not ENGINES[self.engine].tasks and self.tasks:
            # plain lm-eval runs them in llama.cpp or vLLM (docs/eval.md)
            p.add(f"{f('tasks')} runs lm-eval on transformers: use {f('engine')} hf for tasks.")
        if not (self.ppl_data or self.bench or self.tasks):
            p.add(f"Nothing to evaluate: pass {f('ppl_data')} FILE, {f('bench')} and/or {f('tasks')} NAMES.")
        p.raise_if_any()
