"""What ``gqakit replicate`` runs: the model it pretrains, the arms it converts and uptrains (the GQA
paper's Fig. 4, 5 and 6 and its from-scratch comparison; docs/replicate.md), and its options."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from gqakit.cli_options import opt
from gqakit.errors import GqakitError
from gqakit.pipelines.starts import STARTS, STARTS_HELP
from gqakit.pipelines.steps import PipelineOptions, at_least, out_field, work_dir_field
from gqakit.problems import Problems
from gqakit.uptrain import load_recipe

UPTRAIN_LR = 5e-4  # the uptraining runs' peak rate (--set train.lr changes it); docs/replicate.md: why
EVAL_TOKENS, DECODE_ROUNDS = 16384, 3  # test tokens scored per model; interleaved decode rounds per G


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


@dataclass(kw_only=True)
class ReplicateOptions(PipelineOptions):
    """Options of ``gqakit replicate`` (and the common ones of
    :class:`~gqakit.pipelines.steps.PipelineOptions`).

    The fields without a flag are for Python callers and tests: the seeds of the headline comparison
    (Fig. 4's methods at the middle alpha), the K/V head counts of the G sweep (G = H, the MHA model
    itself, is always shown), the model's shape, the pretraining run (the uptraining runs use its batch
    and schedule shape at :data:`UPTRAIN_LR`) and the corpus (train, validation, test; None: the wiki-en
    asset).
    """

    out: Path = out_field("replicate-report", "Directory for report.md, results.json and the figures.")
    work_dir: Path = work_dir_field("replicate-work")
    scale: float = opt(
        1.0,
        "Model width (x) and depth (x sqrt) and every token budget: 1 runs in under an hour on 2 CPU "
        "cores; 4 or more for a GPU.",
    )
    alphas: tuple[float, ...] = opt(
        (0.0, 0.025, 0.05, 0.1), "Uptraining proportions of the pretraining tokens.", kind=float
    )
    starts: tuple[str, ...] = opt(
        ("mean", "first", "random", "calibrated", "fast"),
        f"Starts of the MQA arms: {STARTS_HELP}.",
    )
    seeds: tuple[int, ...] = opt((0, 1), cli=False)
    groups: tuple[int, ...] = opt((1, 2, 4), cli=False)
    shape: ModelShape = opt(factory=ModelShape, cli=False)
    pretrain_steps: int = opt(500, cli=False)
    batch_size: int = opt(16, cli=False)
    corpus: tuple[Path, Path, Path] | None = opt(None, cli=False)

    def check(self, p: Problems) -> None:
        """Add every problem with these options to ``p`` (:func:`gqakit.problems.check_options`)."""
        super().check(p)
        f = p.flag
        if not self.scale > 0:
            p.add(f"{f('scale')} must be positive, got {self.scale}.")
        if not self.seeds:
            p.add(f"{f('seeds')} needs at least one seed.")
        self._check_alphas(p)
        bad = [g for g in self.groups if g < 1 or self.shape.heads % g or g >= self.shape.heads]
        if bad:
            p.add(
                f"{f('groups')} {','.join(map(str, bad))}: each must divide the {self.shape.heads} heads and "
                f"be fewer (G = {self.shape.heads} is the MHA model itself)."
            )
        if not self.starts:
            p.add(f"{f('starts')} needs at least one start: {', '.join(STARTS.names)}.")
        p.add(STARTS.unknown_in(self.starts, f("starts")))
        at_least(p, self, 1, "pretrain_steps", "batch_size")
        if not p and self.recipe_sets:  # a bad --set key or value, before any asset is fetched
            try:
                load_recipe("replicate-mha", list(self.recipe_sets))
            except GqakitError as e:
                p.add(e.message)

    def _check_alphas(self, p: Problems) -> None:
        """Add to ``p`` what is wrong with :attr:`alphas`: each must be finite, they must increase from 0
        (the conversions alone: Fig. 4's starts and the first point of every Fig. 5 curve, which the report
        measures everything against), and each above 0 must give at least one uptraining step."""
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
