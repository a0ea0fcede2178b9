"""What ``gqakit eval`` measured: one :class:`ModelResult` per model, and :class:`EvalResults` over them
with the comparisons against the baseline and the environment they ran in."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gqakit import __version__
from gqakit.eval.decode import DecodePoint
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import PerplexityResult
from gqakit.eval.serving import ServingResult
from gqakit.geometry import AttentionGeometry
from gqakit.models import cpu_model


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
        serving: KV capacity and greedy agreement, from a serving engine (vLLM).
        cached_kv_heads: the K/V heads per layer the engine's cache holds, where they differ from
            ``num_kv_heads`` (transformers' Falcon-40B layout caches all H); ``kv_bytes_per_token`` counts
            these. None where the cache holds the weights' heads.
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
    serving: ServingResult | None = None
    cached_kv_heads: int | None = None

    @classmethod
    def of(
        cls, label: str, path: str, geom: AttentionGeometry, *, parameters: int, dtype: str,
        kv_dtype_bytes: int, weight_bytes: int, load_s: float, cached: AttentionGeometry | None = None,
    ) -> ModelResult:  # fmt: skip
        """A result for a model of attention geometry ``geom``, before anything is measured on it (every
        engine starts from this); its KV bytes per token are those of ``cached``, the heads the engine's
        cache holds, where they differ from the weights' (transformers' Falcon-40B layout)."""
        return cls(
            label=label,
            path=str(path),
            model_type=geom.model_type,
            num_layers=geom.num_layers,
            num_heads=geom.num_heads,
            num_kv_heads=geom.num_kv_heads,
            head_dim=geom.head_dim,
            parameters=parameters,
            dtype=dtype,
            kv_bytes_per_token=(cached or geom).kv_bytes_per_token(dtype_bytes=kv_dtype_bytes),
            weight_bytes=weight_bytes,
            load_s=load_s,
            cached_kv_heads=cached.num_kv_heads
            if cached and cached.num_kv_heads != geom.num_kv_heads
            else None,
        )

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
                reliable = p.reliable and b.reliable  # rounds that disagree give no speedup
                c["decode"].append(
                    {
                        "batch": p.batch,
                        "context": p.context,
                        "speedup": p.tokens_per_s / b.tokens_per_s if ok and reliable else None,
                        "reliable": reliable,
                        "bound": b.bytes_per_step / p.bytes_per_step,
                        "kv_bytes_ratio": (
                            p.kv_bytes / b.kv_bytes if ok and p.kv_bytes and b.kv_bytes else None
                        ),
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
    # deferred: transformers takes seconds to import
    import datasets
    import lm_eval
    import transformers

    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"{cpu_model()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"
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


__all__ = ["EvalResults", "ModelResult", "environment"]
