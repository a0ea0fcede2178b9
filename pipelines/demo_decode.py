"""The demo's decode speed: every model measured side by side, in short interleaved rounds, with the
spread reported and a speedup printed only when the rounds agree.

A background job that starts or stops while the models are measured one after another can fake a
speedup of any size (a loaded machine once showed MHA-9 at 2.9 tokens/s and MQA at 49.8, "16.96x").
So every model is loaded once, and then each round runs a short decode of every model back to back, in
an order that rotates from round to round; a change of load hits every model in the rounds it spans.
Each model's figure is the median of its rounds, and its spread is ``(max - min) / median``: when that
exceeds :data:`DECODE_TOLERANCE`, the figure is marked unreliable and no speedup is computed from it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit.pipelines.steps import Steps
from gqakit.pipelines.store import ResultStore, fingerprint

if TYPE_CHECKING:
    from gqakit.pipelines.demo_measure import ModelEval, Settings

# A model's rounds may spread by this fraction of their median before its figure counts as unreliable:
# on a quiet 2-core CPU rounds of one model spread by under 10%; a job starting mid-measurement, by more.
DECODE_TOLERANCE = 0.25


@dataclass(frozen=True)
class RoundStats:
    """A model's decode rounds (tokens/s; None for a round that ran out of memory) and their summary.

    Attributes:
        rounds: tokens/s of each round, in the order measured.
        median: the median round (None when every round ran out of memory).
        spread: ``(max - min) / median`` over the rounds.
        reliable: the spread is within the tolerance (and some round ran).
    """

    rounds: tuple[float | None, ...]
    median: float | None
    spread: float | None
    reliable: bool

    def describe(self) -> str:
        if self.median is None:
            return "out of memory"
        text = f"{self.median:,.1f} tok/s, spread {100 * (self.spread or 0):.0f}%"
        return text if self.reliable else text + " (unreliable: the load changed during the measurement)"


def round_stats(rounds: Sequence[float | None], tolerance: float = DECODE_TOLERANCE) -> RoundStats:
    """Summarize one model's rounds: median, spread, and whether the spread is within ``tolerance``."""
    ran = [r for r in rounds if r]
    if not ran:
        return RoundStats(tuple(rounds), None, None, False)
    med = statistics.median(ran)
    spread = (max(ran) - min(ran)) / med
    return RoundStats(tuple(rounds), med, spread, spread <= tolerance and len(ran) == len(rounds))


def speedup(row: RoundStats | None, base: RoundStats | None) -> str:
    """The table's speedup cell: the ratio of medians, or why there is none."""
    if row is None or base is None or row.median is None or base.median is None:
        return "-"
    if not (row.reliable and base.reliable):
        return "unreliable"
    return f"{row.median / base.median:.2f}x"


def decode_side_by_side(evals: list[ModelEval], s: Settings, store: ResultStore, steps: Steps) -> None:
    """Measure the decode point of every model in ``evals`` in ``s.decode_rounds`` interleaved rounds and
    attach each model's median point and :class:`RoundStats` to it (cached by models and settings)."""
    from gqakit.eval import DecodePoint

    key = {
        "models": [
            [e.label, str(Path(e.result.path).resolve()), fingerprint(Path(e.result.path))] for e in evals
        ],
        "pick": "median of interleaved rounds",
        **asdict(s),
    }
    cached = store.get("decode-side-by-side", key)
    if cached is None:
        points = _measure(evals, s)
        cached = {"points": [[p.to_dict() for p in ps] for ps in points]}
        store.put("decode-side-by-side", key, cached)
    else:
        steps.note("cached")
    for e, raw in zip(evals, cached["points"], strict=True):
        points = [DecodePoint(**p) for p in raw]
        e.decode_stats = round_stats([p.tokens_per_s for p in points])
        ok = sorted((p for p in points if p.tokens_per_s), key=lambda p: p.tokens_per_s)
        e.result.decode = [ok[(len(ok) - 1) // 2] if ok else points[0]]  # the median round's point
        rounds = " / ".join(f"{p.tokens_per_s:,.1f}" if p.tokens_per_s else "OOM" for p in points)
        steps.note(f"{e.label}: {e.decode_stats.describe()} (rounds: {rounds})")


def _measure(evals: list[ModelEval], s: Settings) -> list[list[Any]]:
    """Every model loaded once; then rounds, each a short decode of every model in a rotated order. The
    cache is filled with random keys and values (``prefill="random"``): a decode step reads every cached
    entry whatever it holds, and no round pays for a prompt."""
    import torch

    from gqakit.eval import bench_decode
    from gqakit.models import load_causal_lm

    models = [load_causal_lm(e.result.path, dtype=s.dtype, device=s.device) for e in evals]
    runs: list[list[Any]] = [[] for _ in evals]
    try:
        for r in range(s.decode_rounds):
            shift = r % len(evals)
            for i in list(range(shift, len(evals))) + list(range(shift)):
                runs[i] += bench_decode(
                    models[i],
                    batch_sizes=(s.decode_batch,),
                    contexts=(s.decode_context,),
                    new_tokens=s.new_tokens,
                    warmup=1 if r == 0 else 0,  # first-call and allocator costs out of the first round
                    progress=False,
                    prefill="random",
                )
    finally:
        del models
        if s.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return runs


def llamacpp_side_by_side(evals: list[ModelEval], s: Settings, store: ResultStore, steps: Steps) -> bool:
    """The same rounds in llama.cpp (each model exported to an f16 GGUF once, batch 1 at the demo's
    context), attached as ``llamacpp_stats``; False (and a note with the install command) when the
    binding is not installed."""
    from gqakit.errors import GqakitError
    from gqakit.eval.llamacpp_engine import INSTALL, gguf_for, llamacpp_decode, require_llama_cpp

    try:
        require_llama_cpp()
    except GqakitError:
        steps.note(f"llama.cpp column skipped: its Python binding is not installed ({INSTALL})")
        return False
    key = {
        "models": [[e.label, fingerprint(Path(e.result.path))] for e in evals],
        "engine": "llama.cpp f16, batch 1",
        **{k: v for k, v in asdict(s).items() if k in ("decode_context", "new_tokens", "decode_rounds")},
    }
    cached = store.get("decode-llamacpp", key)
    if cached is None:
        from gqakit.checkpoint import read_config
        from gqakit.geometry import AttentionGeometry

        ggufs = [gguf_for(e.result.path, "f16") for e in evals]
        geoms = [AttentionGeometry.from_config(read_config(Path(e.result.path))) for e in evals]
        runs: list[list[float | None]] = [[] for _ in evals]
        for r in range(s.decode_rounds):
            shift = r % len(evals)
            for i in list(range(shift, len(evals))) + list(range(shift)):
                points, _ = llamacpp_decode(ggufs[i], geoms[i], [s.decode_context], s.new_tokens, False, r)
                runs[i].append(points[0].tokens_per_s)
        cached = {"rounds": runs}
        store.put("decode-llamacpp", key, cached)
    else:
        steps.note("llama.cpp: cached")
    for e, rounds in zip(evals, cached["rounds"], strict=True):
        e.llamacpp_stats = round_stats(rounds)
        steps.note(f"{e.label}: llama.cpp {e.llamacpp_stats.describe()}")
    return True


__all__ = [
    "DECODE_TOLERANCE",
    "RoundStats",
    "decode_side_by_side",
    "llamacpp_side_by_side",
    "round_stats",
    "speedup",
]
