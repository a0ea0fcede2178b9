"""Options of ``gqakit convert``: the typed dataclass, its validation, and the checks on G."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.pooling import METHODS
from gqakit.convert.refine import REFINE_LR
from gqakit.errors import GqakitError
from gqakit.geometry import AttentionGeometry

# Every --method of convert: the pooling methods, and the activation-aware merge (gqakit.convert.merge).
CONVERT_METHODS: tuple[str, ...] = (*METHODS, "calibrated")
# Methods that --grouping similarity can combine with (random ignores the weights, so grouping is moot).
SIMILARITY_METHODS: tuple[str, ...] = ("mean", "first", "calibrated")

# CLI dtype names -> safetensors dtype names (None: keep each tensor's own).
DTYPE_CHOICES: dict[str, str | None] = {"keep": None, "bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_CONFIG_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class ConvertOptions:
    """Options of ``gqakit convert``.

    Attributes:
        groups: K/V heads in the output (G). 1 is MQA.
        method: ``mean`` (the paper's), ``first``, ``random``, or ``calibrated`` (activation-aware
            merge with q/o compensation; needs ``calib_data``).
        dtype: ``keep``, ``bfloat16``, ``float16`` or ``float32`` for every floating tensor.
        seed: seed for ``random``.
        force: replace a non-empty output directory.
        calib_data: calibration text (``.txt``/``.jsonl``/``.parquet``) for ``calibrated`` and
            ``similarity``.
        calib_tokens: calibration tokens to run through the model.
        grouping: ``contiguous`` (what ``repeat_kv`` implies) or ``similarity`` (groups chosen by the
            merge's reconstruction error on the calibration data, heads reordered to match).
        device: where calibration runs: ``auto``, ``cpu``, ``cuda``...
        refine_steps: Adam steps per layer fitting each converted attention block to the original's
            output on the calibration data (``gqakit.convert.refine``); 0 skips it. Needs ``calib_data``.
        refine_lr: the learning rate of those steps.
    """

    groups: int
    method: str = "mean"
    dtype: str = "keep"
    seed: int = 0
    force: bool = False
    calib_data: str | None = None
    calib_tokens: int = 4096
    grouping: str = "contiguous"
    device: str = "auto"
    refine_steps: int = 0
    refine_lr: float = REFINE_LR

    @property
    def merged(self) -> bool:
        """True when this conversion goes through the merge path (calibration and/or head grouping)."""
        return self.method == "calibrated" or self.grouping == "similarity"

    def validate(self) -> None:
        problems = []
        if self.groups <= 0:
            problems.append(f"--groups must be a positive number of K/V heads, got {self.groups}.")
        if self.method not in CONVERT_METHODS:
            problems.append(
                f"--method {self.method!r} is unknown; choose one of {', '.join(CONVERT_METHODS)}."
            )
        if self.dtype not in DTYPE_CHOICES:
            problems.append(f"--dtype {self.dtype!r} is unknown; choose one of {', '.join(DTYPE_CHOICES)}.")
        if self.grouping not in GROUPINGS:
            problems.append(f"--grouping {self.grouping!r} is unknown; choose one of {', '.join(GROUPINGS)}.")
        if self.calib_tokens <= 0:
            problems.append(f"--calib-tokens must be a positive number of tokens, got {self.calib_tokens}.")
        if self.refine_steps < 0:
            problems.append(
                f"--refine-steps must be 0 (off) or a positive step count, got {self.refine_steps}."
            )
        if not self.refine_lr > 0:
            problems.append(f"--refine-lr must be a positive learning rate, got {self.refine_lr}.")
        needs = [
            w
            for w, on in (
                ("--method calibrated", self.method == "calibrated"),
                ("--grouping similarity", self.grouping == "similarity"),
                ("--refine-steps", self.refine_steps > 0),
            )
            if on
        ]
        if needs and not self.calib_data:
            problems.append(
                f"{' and '.join(needs)} need calibration text: pass --calib-data FILE (.txt, .jsonl or "
                ".parquet), e.g. the train split of `gqakit assets fetch wiki-en`."
            )
        if self.calib_data and not needs:
            problems.append(
                f"--calib-data is only used by --method calibrated, --grouping similarity or --refine-steps; "
                f"add one of them, or drop --calib-data for --method {self.method}."
            )
        if self.calib_data and not Path(self.calib_data).expanduser().is_file():
            problems.append(f"--calib-data {self.calib_data} does not exist or is not a file.")
        if self.refine_steps > 0 and self.method == "random":
            problems.append(
                "--refine-steps cannot start from --method random (the blocks would be trained from scratch "
                "on a few thousand tokens); use --method calibrated or mean."
            )
        if self.grouping == "similarity" and self.method not in SIMILARITY_METHODS and self.method in METHODS:
            problems.append(
                f"--grouping similarity cannot be combined with --method {self.method}; use one of "
                f"{', '.join(SIMILARITY_METHODS)}."
            )
        if problems:
            raise GqakitError(" ".join(problems))


def check_groups(geom: AttentionGeometry, groups: int) -> None:
    """Raise a clear error unless pooling ``geom``'s K/V heads into ``groups`` heads is possible."""
    if groups <= 0:
        raise GqakitError(f"--groups must be a positive number of K/V heads, got {groups}.")
    valid = ", ".join(map(str, geom.valid_groups()))
    if groups > geom.num_kv_heads:
        raise GqakitError(
            f"--groups {groups} is more than the {geom.num_kv_heads} K/V heads this checkpoint has; pooling "
            f"cannot add heads. Valid --groups: {valid}. To get more K/V heads, run `gqakit expand SRC DST` "
            f"first (it gives {geom.num_heads}, exactly equivalent) and convert that."
        )
    if geom.num_kv_heads % groups:
        raise GqakitError(
            f"--groups {groups} does not divide the {geom.num_kv_heads} K/V heads of this checkpoint. "
            f"Valid --groups: {valid}."
        )
