"""The options of ``gqakit recovery``: the source, the starts, the data and the uptraining run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from gqakit.cli_options import Problems, device_problem, finite_positive, rate_problem
from gqakit.convert.refine import REFINE_QK_LR
from gqakit.convert.refine_names import REFINE_LOSSES, REFINE_SCHEDULES, REFINE_TARGETS
from gqakit.files import fingerprint
from gqakit.pipelines.starts import REFINED, STARTS
from gqakit.uptrain.schedule import warmup_steps

LR = 2e-4  # the uptraining rate every start shares unless --start-lr gives it its own

DEFAULT_STARTS = ("mean", "calibrated", REFINED)
OBJECTIVES = ("distill", "lm")
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class RecoveryOptions:
    """Options of ``gqakit recovery``.

    Attributes:
        src: the original checkpoint (directory, ``.gguf`` or hub id).
        groups: K/V heads after conversion (1 = MQA).
        data: one text file (one document per line), split by document into training, calibration
            and held-out text; None: the wiki-en asset's train / validation / test splits.
        tokens: uptraining tokens per start (rounded up to whole steps).
        starts: the starts (:data:`~gqakit.pipelines.starts.STARTS`), one curve each; the first
            is the reference the savings are computed against (mean pooling by default).
        lr: peak learning rate of every start.
        start_lr: a start's own learning rates, ``START=LR[,LR...]`` (``refined=1e-4``); several rates
            for one start make one run each, and the savings compare each start at its best measured
            rate per threshold (``refined=1e-4,2e-4,4e-4``).
        objective: ``distill`` (KL to the original, the default) or ``lm``.
        precision: ``auto`` (bf16 autocast where the CPU or GPU has bf16 instructions, else fp32),
            ``bf16`` or ``fp32``; the weights stay float32.
        seq_len, batch_size: the packed blocks and blocks per step (one step = their product in tokens).
        warmup_steps: linear warmup, then a constant learning rate, so that the point at N tokens is
            what a run stopped at N tokens gives; at most half the run (:attr:`warmup_run`).
        evals_per_decade: log-spaced held-out evaluations per factor of ten tokens.
        eval_tokens: held-out tokens per evaluation.
        calib_tokens, refine_steps: the calibrated and refined conversions.
        refine_target, refine_qk_lr, refine_schedule, refine_loss: the refined start's refinement
            (``gqakit convert --refine-target`` and the others of those names).
        checkpoint_every: steps between resumable checkpoints of each run.
        out, work_dir: the report, and the checkpoints and cached results (a rerun reuses them).
        fresh: recompute everything.
        device, seed: where to run, and the seed of data order and initialisation.
        cache_dir, wheelhouse: the asset cache and a wheel directory (offline machines).
        progress: progress bars.
        echo: where step lines go.
    """

    src: str
    groups: int
    data: Path | None = None
    tokens: int = 200_000
    starts: tuple[str, ...] = DEFAULT_STARTS
    lr: float = LR
    start_lr: tuple[str, ...] = ()
    objective: str = "distill"
    precision: str = "auto"
    seq_len: int = 256
    batch_size: int = 4
    warmup_steps: int = 10
    evals_per_decade: int = 4
    eval_tokens: int = 8192
    calib_tokens: int = 4096
    refine_steps: int = 200
    refine_target: str = "attention"
    refine_qk_lr: float = REFINE_QK_LR
    refine_schedule: str = "constant"
    refine_loss: str | None = None
    checkpoint_every: int = 25
    out: Path = Path("recovery-report")
    work_dir: Path = Path("recovery-work")
    fresh: bool = False
    device: str = "auto"
    seed: int = 0
    cache_dir: Path | None = None
    wheelhouse: Path | None = None
    progress: bool = True
    echo: Callable[[str], None] = field(default=lambda msg: click.echo(msg, err=True), repr=False)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def steps(self) -> int:
        """Optimizer steps per start: ``tokens`` rounded up to whole steps."""
        return -(-self.tokens // self.tokens_per_step)

    @property
    def warmup_fraction(self) -> float:
        """The recipe's ``warmup_fraction``: ``warmup_steps`` of the run, at most half of it (a longer
        warmup would leave too little of a short run at the peak rate to measure it)."""
        if not self.warmup_steps:
            return 0.0
        # the half step makes the fraction round down to exactly warmup_steps whole steps
        return min((self.warmup_steps + 0.5) / self.steps, 0.5)

    @property
    def warmup_run(self) -> int:
        """The warmup steps each run actually takes: ``warmup_steps``, or half the run where that is
        fewer; what the report states."""
        return warmup_steps(self.warmup_fraction, self.steps)

    @property
    def refine(self) -> dict[str, Any]:
        """The refined start's refinement options, by their ``gqakit convert`` option names."""
        names = ("refine_target", "refine_qk_lr", "refine_schedule", "refine_loss")
        return {name: getattr(self, name) for name in names}

    def rates_of(self, start: str) -> tuple[float, ...]:
        """The peak learning rates ``start`` is uptrained at, one run each: its own from ``start_lr``
        (in the order given), else ``lr`` alone."""
        own: list[float] = []
        for item in self.start_lr:
            name, rates = _rates(item)
            if name == start:
                own.extend(rates)
        return tuple(dict.fromkeys(own)) or (self.lr,)

    def swept(self, start: str) -> bool:
        """True when ``start`` is uptrained at more than one rate."""
        return len(self.rates_of(start)) > 1

    def validate(self) -> None:
        """Every problem with the options at once, before any model is read."""
        p = Problems("recovery")
        f = p.flag
        p.add(device_problem(self.device, f("device")))
        if self.groups < 1:
            p.add(f"{f('groups')} must be a positive number of K/V heads, got {self.groups}.")
        if not self.starts:
            p.add(f"{f('starts')} needs at least one of {', '.join(STARTS)}.")
        p.add(STARTS.unknown_in(self.starts, f("starts")))
        dup = sorted({s for s in self.starts if self.starts.count(s) > 1})
        if dup:
            p.add(f"{f('starts')} names {', '.join(dup)} more than once.")
        if self.tokens < self.tokens_per_step:
            p.add(
                f"{f('tokens')} {self.tokens:,} is smaller than the first evaluation point, one step of "
                f"{self.tokens_per_step:,} tokens ({f('batch_size')} {self.batch_size} x {f('seq_len')} "
                f"{self.seq_len}); give at least {self.tokens_per_step:,}."
            )
        given: dict[str, list[float]] = {}
        for item in self.start_lr:
            try:
                start, rates = _rates(item)
            except ValueError:
                p.add(
                    f"{f('start_lr')} {item!r} must be START=LR or START=LR,LR,..., e.g. refined=1e-4 "
                    "or refined=1e-4,4e-4."
                )
                continue
            p.add(STARTS.unknown(start, f"{f('start_lr')} start", among=self.starts))
            bad = next((lr for lr in rates if not finite_positive(lr)), None)
            if bad is not None:
                p.add(rate_problem(f"{f('start_lr')} {item!r}", bad, LR))
            given.setdefault(start, []).extend(rates)
        for start, rates in given.items():
            twice = sorted({lr for lr in rates if rates.count(lr) > 1})
            if twice:
                # two runs at one rate would be the same run: a typo, or a pick by result
                p.add(
                    f"{f('start_lr')} gives {start} the rate {', '.join(f'{lr:g}' for lr in twice)} more "
                    "than once; list each rate once."
                )
        p.add(rate_problem(f("lr"), self.lr, LR))
        if self.objective not in OBJECTIVES:
            p.add(f"{f('objective')} {self.objective!r} is unknown; choose one of {', '.join(OBJECTIVES)}.")
        p.add(REFINE_TARGETS.unknown(self.refine_target, f("refine_target")))
        p.add(REFINE_SCHEDULES.unknown(self.refine_schedule, f("refine_schedule")))
        if self.refine_loss is not None:
            p.add(REFINE_LOSSES.unknown(self.refine_loss, f("refine_loss")))
        p.add(rate_problem(f("refine_qk_lr"), self.refine_qk_lr, REFINE_QK_LR))
        if self.precision not in PRECISIONS:
            p.add(f"{f('precision')} {self.precision!r} is unknown; choose one of {', '.join(PRECISIONS)}.")
        for name in (
            "seq_len", "batch_size", "evals_per_decade", "eval_tokens", "calib_tokens", "refine_steps",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                p.add(f"{f(name)} must be at least 1, got {getattr(self, name)}.")
        for name in ("warmup_steps", "checkpoint_every"):
            if getattr(self, name) < 0:
                p.add(f"{f(name)} must be >= 0, got {getattr(self, name)}.")
        if self.data is not None and not Path(self.data).expanduser().is_file():
            p.add(f"{f('data')} {self.data} does not exist or is not a file.")
        if Path(self.out).resolve() == Path(self.work_dir).resolve():
            p.add(f"{f('out')} and {f('work_dir')} must differ.")
        p.raise_if_any()


@dataclass
class Inputs:
    """The resolved inputs: the original checkpoint and the three text files."""

    src: str
    train: Path
    calibration: Path
    heldout: Path

    def texts(self, *names: str) -> dict[str, str]:
        """The fingerprints of the named text files (``"train"``, ``"calibration"``, ``"heldout"``), for
        the cache key of a step that reads them: the split of ``--data`` is always written to the same
        paths, so a key holding only the paths would serve one file's results for another's."""
        return {name: fingerprint(getattr(self, name)) for name in names}


def _rates(item: str) -> tuple[str, tuple[float, ...]]:
    """``"refined=1e-4,4e-4"`` -> ``("refined", (1e-4, 4e-4))``; ValueError when it is not
    START=NUMBER[,NUMBER...]."""
    name, sep, values = item.partition("=")
    if not sep:
        raise ValueError(item)
    return name.strip(), tuple(float(v) for v in values.split(","))


__all__ = ["DEFAULT_STARTS", "OBJECTIVES", "PRECISIONS", "Inputs", "RecoveryOptions"]
