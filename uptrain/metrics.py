"""The uptraining run's records: ``metrics.jsonl`` (one JSON object per logged step and evaluation),
TensorBoard when installed, and the log lines."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("gqakit.uptrain")

METRICS = "metrics.jsonl"


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (main process only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run writes them again), and a line a kill cut short."""
        if self.enabled and self.path.is_file():
            keep = [ln for ln in self.path.read_text().splitlines() if _step(ln) <= step]
            self.path.write_text("".join(ln + "\n" for ln in keep))


def _step(line: str) -> float:
    """The step of one ``metrics.jsonl`` line; infinity for a line that is not a whole record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return float("inf")
    step = record.get("step", 0) if isinstance(record, dict) else None
    return step if isinstance(step, int | float) else float("inf")


def read_history(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``: training steps (``loss``...), evaluations (``val_ppl``)."""
    path = Path(output_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsMixin:
    """The loop's logging: training records every ``log.every`` steps, evaluation records, trackers."""

    def _setup_trackers(self) -> None:
        if self.acc.log_with:
            flat = _flatten(self.recipe.to_dict())
            self.acc.init_trackers("uptrain", config=flat)

    def _log_train(
        self, stats: torch.Tensor, grad_norm: Any, lr: float, tok_s: float, steps_here: int, elapsed: float
    ) -> None:
        s, b = self.state, self.budget
        record: dict[str, Any] = {"step": s.step, "tokens": b.tokens(s.step), "alpha": b.alpha(s.step)}
        record["loss"] = stats[0].item()
        if "lm" in self._parts():
            record["lm"] = stats[1].item()
        if "kl" in self._parts():
            record["kl"] = stats[2].item()
        record.update(
            lr=lr,
            grad_norm=None if grad_norm is None else float(grad_norm),
            tokens_per_s=tok_s,
            avg_tokens_per_s=steps_here * b.tokens_per_step / max(elapsed, 1e-9),
        )
        self.metrics.write(record)
        self.acc.log({f"train/{k}": v for k, v in record.items() if isinstance(v, float | int)}, step=s.step)

    def _parts(self) -> tuple[str, ...]:
        return {"lm": ("lm",), "distill": ("kl",), "mix": ("lm", "kl")}[self.objective.kind]

    def _log_eval(self, loss: float, ppl: float) -> None:
        s, b = self.state, self.budget
        self.metrics.write(
            {
                "step": s.step,
                "tokens": b.tokens(s.step),
                "alpha": b.alpha(s.step),
                "val_loss": loss,
                "val_ppl": ppl,
            }
        )
        self.acc.log({"val/loss": loss, "val/ppl": ppl}, step=s.step)
        log.info("%s: validation loss %.4f, perplexity %.3f", b.progress(s.step), loss, ppl)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested recipe -> ``{"train.lr": 1e-4, ...}`` with only scalar values (what TensorBoard accepts)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, int | float | str | bool) else str(v)
    return out
