"""What ``gqakit eval`` measured: one :class:`ModelResult` per model, and :class:`EvalResults` over them
with the comparisons against the baseline and the environment they ran in."""

from __future__ import annotations

import datetime
import platform
import sys
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from typing import Any

import torch

from gqakit import __version__
from gqakit.eval.decode import DecodePoint
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import PerplexityResult
from gqakit.geometry import AttentionGeometry
from gqakit.models import device_name


@dataclass
class ServingResult:
    """A model as a serving engine holds it: a paged KV cache (vLLM's) holds ``budget / kv_bytes_per_token``
    tokens, rounded down to whole blocks, so a model with G K/V heads holds H/G times the sequences of its
    MHA original.
    """

    engine: str  # the engine and its version (``vllm 0.32.0``).
    # the KV-cache memory budget on a CPU (None on a GPU, where vLLM sizes it from
    # ``gpu_memory_utilization``).
    kv_budget_bytes: int | None
    kv_tokens: int | None  # tokens the engine's KV cache holds.
    block_size: int  # tokens per KV-cache block.
    context: int  # the sequence length ``max_sequences`` is counted at.
    # sequences of ``context`` tokens the cache holds at once (whole blocks each).
    max_sequences: int | None = None

    def __post_init__(self) -> None:
        if self.kv_tokens is not None and self.max_sequences is None:
            blocks = -(-self.context // self.block_size)
            self.max_sequences = self.kv_tokens // (blocks * self.block_size)


@dataclass
class ModelResult:
    """Everything measured on one model."""

    label: str  # its name in tables and plots.
    path: str  # checkpoint directory or hub id.
    model_type: str  # this and the next four: its attention geometry
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    parameters: int  # parameter count.
    dtype: str  # the dtype it ran in.
    kv_bytes_per_token: int  # KV-cache bytes one token costs in that dtype, over all layers.
    weight_bytes: int  # weight bytes a decode step reads.
    load_s: float  # seconds to load.
    perplexity: PerplexityResult | None = None  # the perplexity result, when ``ppl_data`` was given.
    decode: list[DecodePoint] = field(default_factory=list)  # the decode grid, when ``bench`` was set.
    lm_eval: dict[str, Any] | None = None  # lm-eval's output, when tasks were given.
    serving: ServingResult | None = None  # KV capacity, from a serving engine (vLLM).
    # the K/V heads per layer the engine's cache holds, where they differ from ``num_kv_heads`` (transformers'
    # Falcon-40B layout caches all H); ``kv_bytes_per_token`` counts these. None where the cache holds the
    # weights' heads.
    cached_kv_heads: int | None = None

    @classmethod
    def of(
        cls, label: str, path: str, geom: AttentionGeometry, *, parameters: int, dtype: str,
        kv_dtype_bytes: int, weight_bytes: int, load_s: float, cached: AttentionGeometry | None = None,
    ) -> ModelResult:  # fmt: skip
        """A result for a model of attention geometry ``geom``, before anything is measured on it (every
        engine starts from this); its KV bytes per token are those of ``cached``, the heads the engine's
        cache holds, where they differ from the weights' (transformers' Falcon-40B layout)."""
        shape = ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        cached = cached if cached and cached.num_kv_heads != geom.num_kv_heads else None
        return cls(
            label=label,
            path=str(path),
            **{k: getattr(geom, k) for k in shape},
            parameters=parameters,
            dtype=dtype,
            kv_bytes_per_token=(cached or geom).kv_bytes_per_token(dtype_bytes=kv_dtype_bytes),
            weight_bytes=weight_bytes,
            load_s=load_s,
            cached_kv_heads=cached.num_kv_heads if cached else None,
        )

    def describe(self) -> str:
        """What was measured, in one line: ``perplexity 12.9012 (1.0632 bits/byte, 2,048 tokens); ...``."""
        parts = []
        if p := self.perplexity:
            parts.append(f"perplexity {p.ppl:.4f} ({p.bits_per_byte:.4f} bits/byte, {p.tokens:,} tokens)")
        if self.lm_eval:
            parts.append(f"{len(self.task_metrics())} lm-eval metrics")
        if ok := [d.tokens_per_s for d in self.decode if d.tokens_per_s]:
            parts.append(f"{len(self.decode)} decode points, up to {max(ok):,.1f} tok/s")
        if self.serving and self.serving.kv_tokens is not None:
            parts.append(f"KV capacity {self.serving.kv_tokens:,} tokens")
        return "; ".join(parts)

    def point(self, batch: int, context: int) -> DecodePoint | None:
        return next((p for p in self.decode if p.batch == batch and p.context == context), None)

    def task_metrics(self) -> dict[str, float]:
        """``{"task/metric": value}`` for every numeric lm-eval metric (stderr left out). lm-eval keys a
        metric ``metric,filter``; a filter other than ``none`` stays in the name, ``task/metric
        (filter)``, since tasks such as gsm8k score one metric under several filters."""
        out = {}
        for task, metrics in ((self.lm_eval or {}).get("results") or {}).items():
            for key, value in metrics.items():
                metric, _, flt = key.partition(",")
                if not isinstance(value, (int, float)) or "stderr" in metric or metric == "sample_len":
                    continue
                name = metric if flt in ("", "none") else f"{metric} ({flt})"
                out[f"{task}/{name}"] = float(value)
        return out


@dataclass
class EvalResults:
    """The results of one ``gqakit eval`` run: models in order, the baseline first."""

    models: dict[str, ModelResult]
    baseline: str | None
    options: EvalOptions
    environment: dict[str, Any]

    def comparisons(self) -> dict[str, Any]:
        """Deltas and decode speedups of every model against the baseline (empty without one)."""
        if self.baseline is None:
            return {}
        base = self.models[self.baseline]
        out: dict[str, Any] = {}
        for m in [m for label, m in self.models.items() if label != self.baseline]:
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
                if (b := base.point(p.batch, p.context)) is None:
                    continue
                ok = p.status == "ok" and b.status == "ok"
                reliable = p.reliable and b.reliable  # rounds that disagree give no speedup
                speedup = p.tokens_per_s / b.tokens_per_s if ok and reliable else None
                bound = b.bytes_per_step / p.bytes_per_step
                c["decode"].append(
                    {
                        "batch": p.batch,
                        "context": p.context,
                        "speedup": speedup,
                        "reliable": reliable,
                        "bound": bound,
                        "kv_bytes_ratio": p.kv_bytes / b.kv_bytes
                        if ok and p.kv_bytes and b.kv_bytes
                        else None,
                        "of_bound": None if speedup is None else speedup / bound,
                    }
                )
            out[m.label] = c
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "gqakit_version": __version__,
            "environment": self.environment,
            "options": asdict(self.options),
            "baseline": self.baseline,
            "models": {label: asdict(m) for label, m in self.models.items()},
            "comparisons": self.comparisons(),
        }


def environment(device: torch.device, command_line: str | None) -> dict[str, Any]:
    """Versions, device and command line, for results.json."""
    name = device_name(device).split(": ", 1)[1]  # "cuda: NVIDIA H100": the device is given beside it
    if device.type == "cpu":
        name += f", {torch.get_num_threads()} torch threads"
    return {
        "command_line": command_line if command_line is not None else " ".join(sys.argv),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": name,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {"gqakit": __version__, "torch": torch.__version__}
        | {name: version(name) for name in ("transformers", "lm_eval", "datasets")},
    }
