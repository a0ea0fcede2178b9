"""The typed entry points behind ``gqakit eval``: options, per-model results, and the evaluation loop.

``evaluate(candidate, baseline, options)`` is the CLI's two-model case; ``evaluate_models`` takes any
number of labelled checkpoints (the demo's MHA / GQA / MQA table). Models are loaded one at a time and
freed before the next, so the peak memory is one model's. Every check that needs only the options or
the models' configs runs before any weights are loaded, and all problems are reported together.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from gqakit import __version__
from gqakit.errors import GqakitError
from gqakit.eval.decode import DecodePoint, bench_decode, dtype_bytes, parse_grid, weight_bytes_per_step
from gqakit.eval.lm_eval_bridge import OUR_TASKS, check_tasks, parse_lm_eval_args, run_lm_eval, split_tasks
from gqakit.eval.perplexity import PerplexityResult, max_positions, perplexity
from gqakit.eval.report import write_report
from gqakit.geometry import AttentionGeometry
from gqakit.models import DTYPES, load_causal_lm, load_tokenizer, resolve_device

log = logging.getLogger(__name__)

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

    def __post_init__(self) -> None:
        problems = []
        for name in ("batch_sizes", "contexts"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                object.__setattr__(self, name, parse_grid(value, "--" + name.replace("_", "-")))
            except GqakitError as e:
                problems.append(e.message)
        object.__setattr__(self, "tasks", split_tasks(self.tasks))
        for name in ("seq_len", "batch_size", "new_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}.")
        if self.new_tokens == 1:
            problems.append("--new-tokens must be at least 2 (one prefill token and one decode step).")
        if self.stride is not None and not 1 <= self.stride <= self.seq_len:
            problems.append(f"--stride must be between 1 and --seq-len {self.seq_len}, got {self.stride}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"--max-tokens must be positive, got {self.max_tokens}.")
        if self.warmup < 0:
            problems.append(f"--warmup must be >= 0, got {self.warmup}.")
        if self.dtype not in DTYPES:
            problems.append(f"--dtype {self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}.")
        try:
            resolve_device(self.device)
        except (GqakitError, RuntimeError) as e:
            problems.append(e.message if isinstance(e, GqakitError) else f"--device {self.device!r}: {e}")
        try:
            parse_lm_eval_args(self.lm_eval_args)
        except GqakitError as e:
            problems.append(e.message)
        if not (self.ppl_data or self.bench or self.tasks):
            problems.append("Nothing to evaluate: pass --ppl-data FILE, --bench and/or --tasks NAMES.")
        if problems:
            raise GqakitError(" ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class ModelResult:
    """Everything measured on one model.

    Attributes:
        label: its name in tables and plots.
        path: checkpoint directory or hub id.
        model_type, num_layers, num_heads, num_kv_heads, head_dim: its attention geometry.
        parameters: parameter count.
        dtype: the dtype it ran in.
        kv_bytes_per_token: KV-cache bytes one token costs in that dtype, over all layers.
        weight_bytes: weight bytes a decode step reads.
        load_s: seconds to load.
        perplexity: the perplexity result, when ``ppl_data`` was given.
        decode: the decode grid, when ``bench`` was set.
        lm_eval: lm-eval's output, when tasks were given.
    """

    label: str
    path: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    parameters: int
    dtype: str
    kv_bytes_per_token: int
    weight_bytes: int
    load_s: float
    perplexity: PerplexityResult | None = None
    decode: list[DecodePoint] = field(default_factory=list)
    lm_eval: dict[str, Any] | None = None

    def point(self, batch: int, context: int) -> DecodePoint | None:
        return next((p for p in self.decode if p.batch == batch and p.context == context), None)

    def task_metrics(self) -> dict[str, float]:
        """``{"task/metric": value}`` for every numeric lm-eval metric (stderr left out)."""
        out = {}
        for task, metrics in ((self.lm_eval or {}).get("results") or {}).items():
            for key, value in metrics.items():
                name = key.split(",")[0]
                if isinstance(value, (int, float)) and "stderr" not in name and name != "sample_len":
                    out[f"{task}/{name}"] = float(value)
        return out


@dataclass
class EvalResults:
    """The results of one ``gqakit eval`` run: models in order, the baseline first."""

    models: dict[str, ModelResult]
    baseline: str | None
    options: EvalOptions
    environment: dict[str, Any]

    def others(self) -> list[ModelResult]:
        return [m for label, m in self.models.items() if label != self.baseline]

    def comparisons(self) -> dict[str, Any]:
        """Deltas and decode speedups of every model against the baseline (empty without one)."""
        if self.baseline is None:
            return {}
        base = self.models[self.baseline]
        out: dict[str, Any] = {}
        for m in self.others():
            c: dict[str, Any] = {}
            if base.perplexity and m.perplexity:
                c["ppl_delta"] = m.perplexity.ppl - base.perplexity.ppl
                c["ppl_delta_pct"] = 100 * (m.perplexity.ppl / base.perplexity.ppl - 1)
                c["bits_per_byte_delta"] = m.perplexity.bits_per_byte - base.perplexity.bits_per_byte
            base_tasks, tasks = base.task_metrics(), m.task_metrics()
            c["task_deltas"] = {k: tasks[k] - base_tasks[k] for k in tasks if k in base_tasks}
            c["kv_cache_ratio"] = m.kv_bytes_per_token / base.kv_bytes_per_token
            c["decode"] = []
            for p in m.decode:
                b = base.point(p.batch, p.context)
                if b is None:
                    continue
                ok = p.status == "ok" and b.status == "ok"
                c["decode"].append(
                    {
                        "batch": p.batch,
                        "context": p.context,
                        "speedup": p.tokens_per_s / b.tokens_per_s if ok else None,
                        "bound": b.bytes_per_step / p.bytes_per_step,
                        "kv_bytes_ratio": (p.kv_bytes / b.kv_bytes) if ok and b.kv_bytes else None,
                    }
                )
            for d in c["decode"]:
                d["of_bound"] = d["speedup"] / d["bound"] if d["speedup"] is not None else None
            out[m.label] = c
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "gqakit_version": __version__,
            "environment": self.environment,
            "options": self.options.to_dict(),
            "baseline": self.baseline,
            "models": {label: asdict(m) for label, m in self.models.items()},
            "comparisons": self.comparisons(),
        }


def environment(device: torch.device, command_line: str | None) -> dict[str, Any]:
    """Versions, device and command line, for results.json."""
    import datasets
    import lm_eval
    import transformers

    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = (
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"{torch.get_num_threads()} torch threads"
        )
    return {
        "command_line": command_line if command_line is not None else " ".join(sys.argv),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": device_name,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            "gqakit": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "lm_eval": getattr(lm_eval, "__version__", "unknown"),
            "datasets": datasets.__version__,
        },
    }


def _model_config(path: str):
    """The config of a causal LM checkpoint, checked without loading weights."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = Path(path).expanduser()
    if not p.exists() and (path.startswith((".", "/", "~")) or path.count("/") != 1):
        raise GqakitError(f"Model path {path} does not exist.")
    if p.is_dir() and not (p / "config.json").is_file():
        raise GqakitError(f"{path} has no config.json: point at a Hugging Face model directory.")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise GqakitError(f"Could not read a model config from {path}: {e}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GqakitError(
            f"{path} is a {config.model_type!r} model, not a causal language model (AutoModelForCausalLM "
            "cannot load it)."
        )
    return config


def _contexts_for(options: EvalOptions, config) -> tuple[list[int], list[str]]:
    """The decode contexts to run for a model, and problems with an explicit grid."""
    limit = max_positions(config)
    if options.contexts is None:
        fit = [c for c in DEFAULT_CONTEXTS if limit is None or c + options.new_tokens <= limit]
        return fit or [max(2, limit - options.new_tokens)], []
    too_long = [c for c in options.contexts if limit is not None and c + options.new_tokens > limit]
    if too_long:
        return [], [
            f"--contexts {','.join(map(str, too_long))} plus --new-tokens {options.new_tokens} is more "
            f"than the {limit} positions of this model; use contexts up to {limit - options.new_tokens}."
        ]
    return list(options.contexts), []


def _preflight(models: dict[str, str], options: EvalOptions) -> tuple[dict[str, Any], list[str] | None]:
    """Check every model's config, the data and the tasks before loading weights; report all problems at
    once. Returns the configs and the evaluation texts."""
    from gqakit.eval.data import load_texts

    problems, configs = [], {}
    for label, path in models.items():
        try:
            config = _model_config(path)
        except GqakitError as e:
            problems.append(f"[{label}] {e.message}")
            continue
        configs[label] = config
        limit = max_positions(config)
        if (options.ppl_data or options.tasks) and limit is not None and options.seq_len > limit:
            problems.append(
                f"[{label}] --seq-len {options.seq_len} is more than this model's {limit} positions "
                f"(max_position_embeddings); use --seq-len {limit} or less."
            )
        if options.bench:
            problems += [f"[{label}] {p}" for p in _contexts_for(options, config)[1]]
    texts = None
    if options.ppl_data:
        try:
            texts = load_texts(options.ppl_data, options.text_field, options.split, options.data_config)
        except GqakitError as e:
            problems.append(e.message)
    if options.tasks:
        try:
            check_tasks(options.tasks, parse_lm_eval_args(options.lm_eval_args))
        except GqakitError as e:
            problems.append(e.message)
    if problems:
        raise GqakitError("\n".join(problems))
    return configs, texts


def _labels(paths: Sequence[str]) -> list[str]:
    names = [Path(p.rstrip("/")).name or p for p in paths]
    if len(set(names)) == len(names):
        return names
    return [f"{n} ({i + 1})" for i, n in enumerate(names)]


def evaluate(candidate: str, baseline: str | None = None, options: EvalOptions | None = None) -> EvalResults:
    """Evaluate ``candidate`` (and ``baseline`` when given) with ``options``; see :func:`evaluate_models`."""
    options = options or EvalOptions()
    paths = [baseline, candidate] if baseline else [candidate]
    labels = _labels(paths)
    return evaluate_models(
        dict(zip(labels, paths, strict=True)), options, baseline=labels[0] if baseline else None
    )


def evaluate_models(models: dict[str, str], options: EvalOptions, baseline: str | None = None) -> EvalResults:
    """Evaluate labelled checkpoints one after another, with one set of options.

    Args:
        models: label -> checkpoint directory or hub id, in table order.
        options: what to measure.
        baseline: the label the others are compared with; None: the first label when there are two or
            more models.

    Returns:
        :class:`EvalResults`; write it with :func:`gqakit.eval.report.write_report`.

    Raises:
        GqakitError: for any input a user can fix, before heavy work where possible.
    """
    if not models:
        raise GqakitError("No model to evaluate.")
    if baseline is None and len(models) > 1:
        baseline = next(iter(models))
    if baseline is not None and baseline not in models:
        raise GqakitError(f"Baseline {baseline!r} is not one of the models: {', '.join(models)}.")
    configs, texts = _preflight(models, options)
    lm_args = parse_lm_eval_args(options.lm_eval_args)
    device = resolve_device(options.device)
    env = environment(device, options.command_line)
    results: dict[str, ModelResult] = {}
    # Baseline first, so its numbers are there when the others are logged.
    order = [baseline] + [k for k in models if k != baseline] if baseline else list(models)
    for label in order:
        path = models[label]
        log.info("[%s] loading %s", label, path)
        torch.manual_seed(options.seed)
        start = time.perf_counter()
        model = load_causal_lm(path, dtype=options.dtype, device=options.device)
        tokenizer = load_tokenizer(path) if (texts is not None or options.tasks) else None
        load_s = time.perf_counter() - start
        geom = AttentionGeometry.from_config(configs[label].to_dict())
        dtype = next(model.parameters()).dtype
        res = ModelResult(
            label=label,
            path=str(path),
            model_type=geom.model_type,
            num_layers=geom.num_layers,
            num_heads=geom.num_heads,
            num_kv_heads=geom.num_kv_heads,
            head_dim=geom.head_dim,
            parameters=sum(p.numel() for p in model.parameters()),
            dtype=str(dtype).removeprefix("torch."),
            kv_bytes_per_token=geom.kv_bytes_per_token(dtype_bytes=dtype_bytes(dtype)),
            weight_bytes=weight_bytes_per_step(model),
            load_s=load_s,
        )
        if texts is not None:
            res.perplexity = perplexity(
                model,
                tokenizer,
                texts,
                seq_len=options.seq_len,
                stride=options.stride,
                batch_size=options.batch_size,
                max_tokens=options.max_tokens,
                progress=options.progress,
            )
            log.info(
                "[%s] perplexity %.4f, %.4f bits/byte over %d tokens",
                label,
                res.perplexity.ppl,
                res.perplexity.bits_per_byte,
                res.perplexity.tokens,
            )
        if options.tasks:
            res.lm_eval = run_lm_eval(
                model,
                tokenizer,
                options.tasks,
                args=lm_args,
                batch_size=options.batch_size,
                max_length=options.seq_len,
                seed=options.seed,
            )
        if options.bench:
            res.decode = bench_decode(
                model,
                batch_sizes=options.batch_sizes,
                contexts=_contexts_for(options, configs[label])[0],
                new_tokens=options.new_tokens,
                warmup=options.warmup,
                static_cache=options.static_cache,
                compile=options.compile,
                progress=options.progress,
                seed=options.seed,
            )
        results[label] = res
        del model, tokenizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ordered = {label: results[label] for label in models}
    return EvalResults(models=ordered, baseline=baseline, options=options, environment=env)


__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_CONTEXTS",
    "EvalOptions",
    "EvalResults",
    "ModelResult",
    "OUR_TASKS",
    "evaluate",
    "evaluate_models",
    "write_report",
]
