"""Decode speed of several models measured side by side: short interleaved rounds, the median round and
its spread, and a speedup only when the rounds agree.

A background job that starts or stops while models are measured one after another can fake a speedup of
any size (a loaded machine once showed MHA-9 at 2.9 tokens/s and MQA at 49.8, "16.96x"). So every model
is loaded once, and then each round runs a short decode of every model back to back, in an order that
rotates from round to round; a change of load hits every model in the rounds it spans. Each model's
figure is the median of its rounds, and its spread is ``(max - min) / median``: when that exceeds
:data:`DECODE_TOLERANCE`, the figure is marked unreliable and no speedup is computed from it.

``gqakit demo`` (its decode step and llama.cpp column) and ``gqakit replicate`` (decode time per G) both
measure this way; they cache the rounds themselves.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.checkpoint import read_config
from gqakit.eval.decode import bench_decode, free_memory
from gqakit.eval.llamacpp_engine import gguf_for, llamacpp_decode, require_llama_cpp
from gqakit.geometry import AttentionGeometry
from gqakit.models import load_causal_lm

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
    """A table's speedup cell: the ratio of medians, or why there is none."""
    if row is None or base is None or row.median is None or base.median is None:
        return "-"
    if not (row.reliable and base.reliable):
        return "unreliable"
    return f"{row.median / base.median:.2f}x"


def interleaved(n_models: int, rounds: int, measure: Callable[[int, int], Any]) -> list[list[Any]]:
    """``measure(model, round)`` for every model in every round, the order rotating by one model per
    round; returns each model's results in round order."""
    runs: list[list[Any]] = [[] for _ in range(n_models)]
    for r in range(rounds):
        shift = r % n_models
        for i in list(range(shift, n_models)) + list(range(shift)):
            runs[i].append(measure(i, r))
    return runs


def decode_rounds(
    paths: Sequence[str | Path],
    *,
    batch: int,
    context: int,
    new_tokens: int,
    rounds: int,
    dtype: str = "auto",
    device: str = "auto",
) -> list[list[Any]]:
    """Each checkpoint's :class:`~gqakit.eval.decode.DecodePoint` per round, in transformers.

    Every model is loaded once; the first round of each model has one untimed warmup (first-call and
    allocator costs). The cache is filled with random keys and values (``prefill="random"``): a decode
    step reads every cached entry whatever it holds, and no round pays for a prompt.
    """
    models = [load_causal_lm(p, dtype=dtype, device=device) for p in paths]

    def one(i: int, r: int) -> Any:
        (point,) = bench_decode(
            models[i], batch_sizes=(batch,), contexts=(context,), new_tokens=new_tokens,
            warmup=1 if r == 0 else 0, progress=False, prefill="random",
        )  # fmt: skip
        return point

    try:
        return interleaved(len(models), rounds, one)
    finally:
        models.clear()  # the caller's cache gets the memory back before anything else loads
        free_memory(device)


def llamacpp_decode_rounds(
    paths: Sequence[str | Path], *, context: int, new_tokens: int, rounds: int
) -> list[list[float | None]]:
    """Each checkpoint's tokens/s per round in llama.cpp (an f16 GGUF export, cached; batch 1).

    Raises:
        GqakitError: with the install command when llama.cpp's Python binding is missing.
    """
    require_llama_cpp()
    ggufs = [gguf_for(str(p), "f16") for p in paths]
    geoms = [AttentionGeometry.from_config(read_config(Path(p))) for p in paths]

    def one(i: int, r: int) -> float | None:
        points, _ = llamacpp_decode(ggufs[i], geoms[i], [context], new_tokens, False, r)
        return points[0].tokens_per_s

    return interleaved(len(paths), rounds, one)
