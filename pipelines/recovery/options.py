"""The options of ``gqakit recovery``: the source, the starts, the data and the uptraining runs, whose
recipe (:func:`gqakit.pipelines.recovery.run.recipe_data`) has the defaults below; ``--set`` changes any
of its keys and, as ``model.convert.*``, the starts' conversion settings (docs/recovery.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gqakit.cli_options import opt
from gqakit.convert import ConvertOptions
from gqakit.pipelines.starts import STARTS, STARTS_HELP, convert_options_for
from gqakit.pipelines.steps import PipelineOptions, at_least, out_field, work_dir_field
from gqakit.pipelines.store import fingerprint
from gqakit.problems import Problems, rate_problem
from gqakit.text import text_file_problem
from gqakit.uptrain.schedule import warmup_steps

LR = 2e-4  # the peak uptraining rate every start shares
# the runs' recipe where --set does not change it: 256-token blocks, 4 per step, 8,192 held-out tokens
SEQ_LEN, BATCH_SIZE, EVAL_TOKENS = 256, 4, 8192
WARMUP_STEPS = 10  # linear warmup, at most half the run, then a constant rate


@dataclass(kw_only=True)
class RecoveryOptions(PipelineOptions):
    """Options of ``gqakit recovery`` (and the common ones of
    :class:`~gqakit.pipelines.steps.PipelineOptions`)."""

    src: str = opt(help="The original checkpoint.")
    groups: int = opt(help="K/V heads after conversion (1 = MQA).")
    starts: tuple[str, ...] = opt(
        ("mean", "calibrated", "fast"),
        f"Starts, one curve each: {STARTS_HELP}; the first is the reference of the savings.",
    )
    data: Path | None = opt(
        None,
        "One text file, one document per line, split into training, calibration and held-out text "
        "[default: the wiki-en asset's train / validation / test splits].",
    )
    tokens: int = opt(200_000, "Uptraining tokens per start.")
    lr: float = opt(LR, "Peak learning rate.")
    evals_per_decade: int = opt(4, "Held-out evaluations per factor of ten tokens.")
    seed: int = opt(0, "Seed of the data order, the random start and the refinement.")
    out: Path = out_field("recovery-report", "Directory for recovery.png, report.md and results.json.")
    work_dir: Path = work_dir_field("recovery-work")

    def recipe_value(self, key: str, default: Any) -> Any:
        """The recipe value ``key`` as the last ``--set`` of it gives it, else ``default``."""
        given = [yaml.safe_load(v) for k, _, v in (s.partition("=") for s in self.recipe_sets) if k == key]
        return given[-1] if given else default

    @property
    def seq_len(self) -> int:
        return self.recipe_value("data.seq_len", SEQ_LEN)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.recipe_value("train.batch_size", BATCH_SIZE)

    @property
    def steps(self) -> int:
        """Optimizer steps per start: ``tokens`` rounded up to whole steps."""
        return -(-self.tokens // self.tokens_per_step)

    @property
    def warmup_fraction(self) -> float:
        """The recipe's ``warmup_fraction``: :data:`WARMUP_STEPS` of the run, at most half of it (a longer
        warmup would leave too little of a short run at the peak rate to measure it)."""
        # the half step makes the fraction round down to exactly WARMUP_STEPS whole steps
        return self.recipe_value("train.warmup_fraction", min((WARMUP_STEPS + 0.5) / self.steps, 0.5))

    @property
    def warmup_run(self) -> int:
        """The warmup steps each run takes; what the report states."""
        return warmup_steps(self.warmup_fraction, self.steps)

    def start_options(self, start: str, calibration: Path | str) -> ConvertOptions:
        """The ``gqakit convert`` options of ``start`` in this recovery run."""
        return convert_options_for(
            start,
            self.groups,
            calib_data=str(calibration),
            sets=self.sets,
            device=self.device,
            seed=self.seed,
        )

    def check(self, p: Problems) -> None:
        """Every problem with the options at once, before any model is read or anything written; the
        source's own checks (G, family, positions, the text) follow in
        :func:`gqakit.pipelines.recovery.run.check_inputs`."""
        super().check(p)
        f = p.flag
        at_least(p, self, 1, "evals_per_decade", "groups")
        if not self.starts:
            p.add(f"{f('starts')} needs at least one of {', '.join(STARTS)}.")
        p.add(STARTS.unknown_in(self.starts, f("starts")))
        dup = sorted({s for s in self.starts if self.starts.count(s) > 1})
        if dup:
            p.add(f"{f('starts')} names {', '.join(dup)} more than once.")
        if self.tokens < self.tokens_per_step:
            p.add(
                f"{f('tokens')} {self.tokens:,} is smaller than the first evaluation point, one step of "
                f"{self.tokens_per_step:,} tokens; give at least {self.tokens_per_step:,}."
            )
        p.add(rate_problem(f("lr"), self.lr, LR))
        if self.data is not None:
            p.add(text_file_problem(self.data, f("data")))


@dataclass
class Inputs:
    """The resolved inputs: the original checkpoint and the three text files (``split``: the parts of
    ``--data`` by name, checked and not written yet; empty for the wiki-en asset's splits)."""

    src: str
    train: Path
    calibration: Path
    heldout: Path
    split: dict[str, list[str]] = field(default_factory=dict)

    def texts(self, *names: str) -> dict[str, str]:
        """The fingerprints of the named text files (``"train"``, ``"calibration"``, ``"heldout"``), for
        the cache key of a step that reads them: the split of ``--data`` is always written to the same
        paths, so a key holding only the paths would serve one file's results for another's."""
        return {name: fingerprint(getattr(self, name)) for name in names}
