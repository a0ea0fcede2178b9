"""The budget in steps, tokens and alpha, and the learning-rate schedule: pure arithmetic, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from gqakit.uptrain.recipe_schema import BudgetConfig


@dataclass(frozen=True)
class Budget:
    """A training budget resolved to whole optimizer steps."""

    steps: int
    tokens_per_step: int  # batch_size * grad_accum * processes * seq_len
    pretraining_tokens: int | None = None  # the model's original pretraining tokens, if the recipe states

    def tokens(self, step: int | None = None) -> int:
        """Tokens trained after ``step`` steps (default: the whole budget)."""
        return (self.steps if step is None else step) * self.tokens_per_step

    def alpha(self, step: int | None = None) -> float | None:
        """Tokens after ``step`` steps as a fraction of the pretraining tokens (None when unknown)."""
        if not self.pretraining_tokens:
            return None
        return self.tokens(step) / self.pretraining_tokens

    def progress(self, step: int) -> str:
        """``step 10/500, 40,960 tokens, alpha 2.05e-08`` for log lines."""
        alpha = self.alpha(step)
        a = f", alpha {alpha:.3g}" if alpha is not None else ""
        return f"step {step:,}/{self.steps:,}, {self.tokens(step):,} tokens{a}"

    def describe(self) -> str:
        """``500 steps = 2,048,000 tokens = alpha 1.02e-06 of 2e+12 pretraining tokens``."""
        head, alpha = f"{self.steps:,} steps = {self.tokens():,} tokens = alpha", self.alpha()
        if alpha is None:
            return f"{head} n/a (set budget.pretraining_tokens)"
        return f"{head} {alpha:.3g} of {self.pretraining_tokens:.3g} pretraining tokens"


def _exact(x: float) -> Fraction:
    """The number as written: a float through its shortest repr (``0.07`` is 7/100, not the binary
    0.07000000000000000666...), so products that are whole numbers on paper stay whole."""
    return Fraction(x) if isinstance(x, int) else Fraction(repr(float(x)))


def resolve_budget(cfg: BudgetConfig, tokens_per_step: int) -> Budget:
    """Turn ``steps`` / ``tokens`` / ``alpha`` into whole steps (rounding tokens up to a full step).

    The arithmetic is exact: a float product would round 0.07 x 12,800 tokens to 896.0000000000001 and
    add a step.
    """
    if cfg.steps is not None:
        steps = cfg.steps
    elif cfg.tokens is not None:
        steps = math.ceil(_exact(cfg.tokens) / tokens_per_step)
    else:  # alpha, with pretraining_tokens: the recipe's validation has refused anything else
        steps = math.ceil(_exact(cfg.alpha) * _exact(cfg.pretraining_tokens) / tokens_per_step)
    return Budget(max(1, steps), tokens_per_step, cfg.pretraining_tokens)


def warmup_steps(warmup_fraction: float, steps: int) -> int:
    """Whole warmup steps: ``warmup_fraction`` of ``steps``, rounded down, computed exactly (a float
    product truncates 0.29 x 100 = 28.999999999999996 to 28)."""
    return math.floor(_exact(warmup_fraction) * steps)


def lr_multiplier(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay from 1 to ``min_ratio`` at ``total``.

    ``step`` counts optimizer steps already taken, so the first update uses ``1 / (warmup + 1)``.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
