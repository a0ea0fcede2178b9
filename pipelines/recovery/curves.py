"""Pure functions of a recovery curve: where to evaluate, when a start reaches a quality, what it saves.

A curve is a list of ``(tokens, ratio)`` points, ``ratio`` = held-out perplexity / the original's, the
first at 0 tokens (the start itself). Nothing here touches a model or a file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

THRESHOLDS = (2.0, 1.5, 1.2, 1.1, 1.05)


def eval_steps(total_steps: int, per_decade: int) -> list[int]:
    """Log-spaced optimizer steps at which to evaluate, from step 1 to ``total_steps`` inclusive.

    ``per_decade`` points per factor of ten (rounded to whole steps, duplicates dropped), so a curve
    has as much detail at 1k tokens as at 1M. Step 0 (the start) is evaluated separately.
    """
    n = max(2, math.ceil(math.log10(total_steps) * per_decade) + 1)
    steps = {round(total_steps ** (i / (n - 1))) for i in range(n)}
    return sorted(s for s in steps | {1, total_steps} if 1 <= s <= total_steps)


@dataclass(frozen=True)
class Reach:
    """The uptraining tokens a start needed to reach a threshold.

    Attributes:
        tokens: the tokens (interpolated between measured points in log tokens), or the last measured
            tokens when ``bound`` is ``">"``.
        bound: ``"="`` reached there, ``"<="`` reached by the first measured point (the exact point is
            below it: between 0 and that point no log interpolation exists), ``">"`` never reached.
    """

    tokens: float
    bound: str

    @property
    def reached(self) -> bool:
        return self.bound != ">"

    def label(self) -> str:
        """``12,345``, ``<= 1,024``, ``> 204,800``, or ``0`` (the start is already there)."""
        n = f"{self.tokens:,.0f}"
        return {"=": n, "<=": f"<= {n}", ">": f"> {n}"}[self.bound]


def tokens_to_reach(curve: list[tuple[float, float]], threshold: float) -> Reach:
    """The first point where ``curve`` (ratio against tokens, sorted by tokens) falls to ``threshold``.

    Between two measured points the ratio is interpolated linearly in log tokens (the axis the curve is
    drawn on); at or below the threshold at 0 tokens is ``Reach(0, "=")``.
    """
    (x0, r0) = curve[0]
    if r0 <= threshold:
        return Reach(x0, "=")
    for (xa, ra), (xb, rb) in zip(curve, curve[1:], strict=False):
        if rb <= threshold < ra:
            if xa <= 0:
                return Reach(xb, "<=")
            frac = (ra - threshold) / (ra - rb)
            return Reach(math.exp(math.log(xa) + frac * (math.log(xb) - math.log(xa))), "=")
    return Reach(curve[-1][0], ">")


@dataclass(frozen=True)
class Saving:
    """How many times fewer tokens a start needs than the reference start to reach a threshold.

    Attributes:
        factor: reference tokens / this start's tokens (None when it cannot be said).
        bound: ``"="``, ``">="`` (a lower bound: the reference never got there, or this start's tokens
            are an upper bound), ``"inf"`` (this start needs no uptraining; the reference does),
            ``"n/a"`` (this start never got there, neither needs any, or the reference got there by its
            first measured point, so its tokens are an upper bound and the factor is unknown).
    """

    factor: float | None
    bound: str

    def label(self) -> str:
        if self.bound == "inf":
            return "no uptraining needed"
        if self.factor is None:
            return "n/a"
        return f"{self.factor:.1f}x" if self.bound == "=" else f">= {self.factor:.1f}x"


def saving(start: Reach, reference: Reach) -> Saving:
    """The savings factor of ``start`` over ``reference`` at one threshold (see :class:`Saving`)."""
    if not start.reached:
        return Saving(None, "n/a")
    if start.tokens == 0:
        return Saving(None, "n/a") if reference.reached and reference.tokens == 0 else Saving(None, "inf")
    # first: with the reference's tokens an upper bound the factor has no lower bound, whatever this
    # start's tokens are (both reached by the first point: either could have got there first)
    if reference.bound == "<=":
        return Saving(None, "n/a")
    factor = reference.tokens / start.tokens
    if not reference.reached or start.bound == "<=":
        return Saving(factor, ">=")
    return Saving(factor, "=")


@dataclass
class Curve:
    """One start's recovery: held-out perplexity at log-spaced uptraining tokens.

    Attributes:
        start: the start's name.
        points: ``(tokens, perplexity)``, the first at 0 tokens (the converted model itself).
        convert_s, train_s: compute time of its conversion and of its uptraining run (as first computed).
        reach: threshold -> the tokens it needed (:class:`~gqakit.pipelines.recovery.curves.Reach`).
    """

    start: str
    points: list[tuple[int, float]]
    convert_s: float
    train_s: float
    reach: dict[float, Reach] = field(default_factory=dict)

    def ratios(self, original: float) -> list[tuple[float, float]]:
        return [(t, p / original) for t, p in self.points]


def savings(curves: list[Curve]) -> dict[str, dict[float, Saving]]:
    """Each start's savings factor over the first curve's start (the reference) at every threshold."""
    ref = curves[0].reach
    return {c.start: {t: saving(c.reach[t], ref[t]) for t in THRESHOLDS} for c in curves[1:]}
