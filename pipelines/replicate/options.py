"""What ``gqakit replicate`` runs: the model it pretrains, the arms it converts and uptrains, and its
options.

The arms, as in the GQA paper (Ainslie et al. 2023):

* Fig. 4: MQA (G = 1) from every conversion method (mean, first, random, and gqakit's calibrated merge,
  with and without layer-wise refinement), uptrained for each proportion alpha of the pretraining
  tokens; the paper's three methods at the middle alpha over every seed (the headline comparison);
* Fig. 6 / Table 1: mean-pooled GQA at every G, uptrained at the largest alpha, beside MHA (G = H);
* trained from scratch: an MQA, a GQA and an MHA model pretrained on the MHA model's tokens plus the
  largest alpha's, the paper's same-budget comparison (the MHA one shows what the tokens alone buy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import click

from gqakit.cli_options import Problems, device_problem, rate_problem
from gqakit.convert.methods import PAPER_METHODS
from gqakit.names import NameTable
from gqakit.pipelines.starts import REFINED, STARTS

# The conversions an MQA arm can start from (gqakit.pipelines.starts): every conversion method, and the
# calibrated merge followed by layer-wise refinement.
ARMS = STARTS

# The architectures of the MHA model pretrained here.
ARCHES: NameTable[str] = NameTable(
    "architecture",
    {
        "llama": "Llama: RMSNorm, rotary, SwiGLU; converts within its own class (the asset replicate-mha)",
        "neox": "GPT-NeoX (Pythia): LayerNorm, parallel attention + MLP, a quarter of each head rotary; "
        "converts into phi (every G)",
    },
)


@dataclass(frozen=True)
class ModelShape:
    """The Llama-architecture model pretrained from scratch: genuinely multi-head (K/V heads = heads)."""

    vocab: int = 4096
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    intermediate: int = 704
    seq_len: int = 128

    def scaled(self, k: float) -> ModelShape:
        """``k`` times the width (heads stay), ``sqrt(k)`` times the depth: for a GPU's ``--scale``."""
        if k == 1:
            return self
        width = max(self.heads, round(self.hidden * k / self.heads) * self.heads)
        return replace(
            self,
            hidden=width,
            intermediate=round(self.intermediate * width / self.hidden / 8) * 8,
            layers=max(1, round(self.layers * k**0.5)),
        )


@dataclass
class ReplicateOptions:
    """Options of ``gqakit replicate``.

    Attributes:
        out: where ``report.md``, ``results.json`` and the figures go.
        work_dir: checkpoints and cached results; a second run reuses them.
        scale: multiply the model's width (and its depth by the root) and every token budget: 1 is the
            CPU default (under an hour on 2 cores); 4 or more for a GPU.
        device: ``auto``, ``cpu``, ``cuda``.
        seeds: seeds of the headline comparison (Fig. 4's methods at the middle alpha).
        alphas: uptraining tokens as a fraction of the pretraining tokens; 0 = the conversion alone.
        groups: the K/V head counts of the G sweep (G = H, the MHA model itself, is always shown).
        methods: conversion methods of the MQA arms.
        shape: the model pretrained from scratch.
        arch: its architecture (:data:`ARCHES`): ``llama``, or ``neox`` (GPT-NeoX, Pythia's block:
            LayerNorm, parallel attention + MLP, partial rotary), whose conversions go into ``phi``.
        pretrain_steps, batch_size, lr: the pretraining run (the uptraining runs use the same batch and
            schedule shape, at ``uptrain_lr``).
        calib_tokens, refine_steps: the calibrated and refined conversions.
        eval_tokens: test tokens every model is scored on.
        decode_rounds: interleaved rounds of the decode measurement per G.
        fresh: recompute everything.
        corpus: (train, validation, test) text files; None: the wiki-en asset. Tests pass their own.
        cache_dir, wheelhouse: the asset cache and a wheel directory (offline machines).
        progress: progress bars of the long steps.
        echo: where step lines go.
    """

    out: Path = Path("replicate-report")
    work_dir: Path = Path("replicate-work")
    scale: float = 1.0
    device: str = "auto"
    seeds: tuple[int, ...] = (0, 1)
    alphas: tuple[float, ...] = (0.0, 0.025, 0.05, 0.1)
    groups: tuple[int, ...] = (1, 2, 4)
    methods: tuple[str, ...] = ARMS.names
    shape: ModelShape = field(default_factory=ModelShape)
    arch: str = "llama"
    pretrain_steps: int = 500
    batch_size: int = 16
    lr: float = 2e-3
    uptrain_lr: float = 5e-4  # docs/replicate.md: 2e-4, 5e-4 and 1e-3 measured
    calib_tokens: int = 4096
    refine_steps: int = 100
    eval_tokens: int = 16384
    decode_rounds: int = 3
    fresh: bool = False
    corpus: tuple[Path, Path, Path] | None = None
    cache_dir: Path | None = None
    wheelhouse: Path | None = None
    progress: bool = True
    echo: Callable[[str], None] = field(default=lambda msg: click.echo(msg, err=True), repr=False)

    def validate(self) -> None:
        p = Problems("replicate")
        f = p.flag
        p.add(device_problem(self.device, f("device")))
        if not self.scale > 0:
            p.add(f"{f('scale')} must be positive, got {self.scale}.")
        for name in ("lr", "uptrain_lr"):  # click reads inf and nan: they would fail after pretraining
            p.add(rate_problem(f(name), getattr(self, name), getattr(type(self), name)))
        if not self.seeds:
            p.add(f"{f('seeds')} needs at least one seed.")
        self._check_alphas(p)
        bad = [g for g in self.groups if g < 1 or self.shape.heads % g or g >= self.shape.heads]
        if bad:
            p.add(
                f"{f('groups')} {','.join(map(str, bad))}: each must divide the {self.shape.heads} heads and "
                f"be fewer (G = {self.shape.heads} is the MHA model itself)."
            )
        if not self.methods:
            p.add(f"{f('methods')} needs at least one method: {', '.join(ARMS.names)}.")
        p.add(ARMS.unknown_in(self.methods, f("methods")))
        p.add(ARCHES.unknown(self.arch, f("arch")))
        for name in ("pretrain_steps", "batch_size", "calib_tokens", "eval_tokens", "decode_rounds"):
            if getattr(self, name) < 1:
                p.add(f"{f(name)} must be at least 1, got {getattr(self, name)}.")
        if Path(self.out).resolve() == Path(self.work_dir).resolve():
            p.add(f"{f('out')} and {f('work_dir')} must differ.")
        p.raise_if_any()

    def _check_alphas(self, p: Problems) -> None:
        """Add to ``p`` what is wrong with :attr:`alphas`: each must be finite, they must increase from 0
        (the conversions alone: Fig. 4's starts and the first point of every Fig. 5 curve, which the report
        measures everything against), and each above 0 must give at least one uptraining step.

        Args:
            p: the problems of these options.
        """
        flag, text = p.flag("alphas"), ",".join(map(str, self.alphas))
        finite = all(math.isfinite(a) for a in self.alphas)
        if not finite or any(a < 0 for a in self.alphas) or sorted(self.alphas) != list(self.alphas):
            p.add(f"{flag} must be increasing, >= 0 and finite, got {text}.")
            return  # uptrain_steps() cannot round an infinite alpha
        if not self.alphas or self.alphas[0] != 0:
            p.add(
                f"{flag} must start at 0, got {text or 'none'}: alpha 0 (the conversions alone) is Fig. 4's "
                "comparison of the starts and where every Fig. 5 curve begins; add it, e.g. "
                f"0,{text or '0.05'}."
            )
        # round(alpha * steps) of 0 would be an "uptrained" arm that is the conversion itself
        if self.tokens_per_step < 1:
            return  # a --batch-size below 1, reported on its own, gives no step count
        short = [a for a in self.alphas if a > 0 and self.uptrain_steps(a) < 1]
        if short:
            p.add(
                f"{flag} {','.join(map(str, short))} gives 0 uptraining steps of the {self.steps} "
                f"pretraining steps: the smallest alpha that gives one step is 1/{self.steps} = "
                f"{1 / self.steps:g} (a larger {p.flag('scale')} trains more steps)."
            )

    @property
    def model(self) -> ModelShape:
        return self.shape.scaled(self.scale)

    @property
    def steps(self) -> int:
        return max(1, round(self.pretrain_steps * self.scale))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    @property
    def pretrain_tokens(self) -> int:
        """The MHA model's pretraining tokens: what alpha is a proportion of."""
        return self.steps * self.tokens_per_step

    def uptrain_steps(self, alpha: float) -> int:
        """Optimizer steps of an uptraining run at ``alpha`` (0 for the conversion alone)."""
        return round(alpha * self.pretrain_tokens / self.tokens_per_step)

    @property
    def middle_alpha(self) -> float:
        nonzero = [a for a in self.alphas if a > 0] or [0.0]
        return nonzero[(len(nonzero) - 1) // 2]


__all__ = ["ARCHES", "ARMS", "PAPER_METHODS", "REFINED", "ModelShape", "ReplicateOptions"]
