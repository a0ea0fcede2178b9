"""Options of ``gqakit convert``: the typed dataclass, its validation, and the checks on G."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gqakit.cli_options import Problems, device_problem, rate_problem
from gqakit.convert.methods import GROUPINGS, MERGE_METHODS, METHODS, needs_calibration
from gqakit.convert.refine import REFINE_LR, REFINE_QK_LR
from gqakit.convert.refine_names import REFINE_LOSSES, REFINE_SCHEDULES, REFINE_TARGETS, target_loss
from gqakit.errors import GqakitError
from gqakit.geometry import AttentionGeometry

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
        refine_target: what each block is fitted to, a name in
            :data:`~gqakit.convert.refine_names.REFINE_TARGETS`: ``attention`` (its output), ``layer``
            (the whole decoder layer's output, attention and MLP through the residual), ``window`` (the
            output two layers on)...
        refine_qk_lr: the learning rate of the query/key side (q, k and their norms); None: ``refine_lr``.
            A fused qkv projection is one tensor and takes ``refine_lr``.
        refine_schedule: how the refinement rates change over each layer's steps, a name in
            :data:`~gqakit.convert.refine_names.REFINE_SCHEDULES` (``constant``, ``cosine``).
        refine_loss: how each refinement batch's error is measured, a name in
            :data:`~gqakit.convert.refine_names.REFINE_LOSSES` (``relative``, ``per-token``); None: the
            target's own (:func:`~gqakit.convert.refine_names.target_loss`).
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
    refine_target: str = "attention"
    refine_qk_lr: float | None = REFINE_QK_LR
    refine_schedule: str = "constant"
    refine_loss: str | None = None

    @property
    def refine_loss_used(self) -> str:
        """The loss the refinement measures with: ``refine_loss``, or the target's own when None."""
        return target_loss(self.refine_target, self.refine_loss)

    @property
    def merged(self) -> bool:
        """True when this conversion goes through the merge path (calibration and/or head grouping)."""
        return needs_calibration(self.method, self.grouping)

    def validate(self) -> None:
        """Raise every problem with these options together (:meth:`check`), fields named by their flags."""
        p = Problems("convert")
        self.check(p)
        p.raise_if_any()

    def check(self, p: Problems, paths: bool = True) -> None:
        """Add every problem with these options to ``p``, each field named as ``p`` names it (a recipe
        names them ``model.convert.*``); ``paths``: whether ``calib_data`` must exist now."""
        f = p.flag
        if self.groups <= 0:
            p.add(f"{f('groups')} must be a positive number of K/V heads, got {self.groups}.")
        p.add(device_problem(self.device, f("device")))
        p.add(METHODS.unknown(self.method, f("method")))
        p.add(GROUPINGS.unknown(self.grouping, f("grouping")))
        if self.dtype not in DTYPE_CHOICES:
            p.add(f"{f('dtype')} {self.dtype!r} is unknown; choose one of {', '.join(DTYPE_CHOICES)}.")
        if self.calib_tokens <= 0:
            p.add(f"{f('calib_tokens')} must be a positive number of tokens, got {self.calib_tokens}.")
        if self.refine_steps < 0:
            p.add(f"{f('refine_steps')} must be 0 (off) or a positive step count, got {self.refine_steps}.")
        p.add(rate_problem(f("refine_lr"), self.refine_lr, REFINE_LR))
        p.add(REFINE_TARGETS.unknown(self.refine_target, f("refine_target")))
        p.add(REFINE_SCHEDULES.unknown(self.refine_schedule, f("refine_schedule")))
        if self.refine_loss is not None:
            p.add(REFINE_LOSSES.unknown(self.refine_loss, f("refine_loss")))
        if self.refine_qk_lr is not None:
            p.add(rate_problem(f("refine_qk_lr"), self.refine_qk_lr, REFINE_QK_LR))
        method = METHODS.get(self.method)
        grouping = GROUPINGS.get(self.grouping)
        needs = [
            w
            for w, on in (
                (f"{f('method')} {self.method}", method is not None and method.needs_calibration),
                (f"{f('grouping')} {self.grouping}", grouping is not None and grouping.needs_calibration),
                (f("refine_steps"), self.refine_steps > 0),
            )
            if on
        ]
        if needs and not self.calib_data:
            verb = "needs" if len(needs) == 1 else "need"
            p.add(
                f"{' and '.join(needs)} {verb} calibration text: give {f('calib_data')} FILE (.txt, .jsonl "
                "or .parquet), e.g. the train split of `gqakit assets fetch wiki-en`."
            )
        if self.calib_data and not needs:
            p.add(
                f"{f('calib_data')} is only used by {f('method')} calibrated, {f('grouping')} similarity or "
                f"{f('refine_steps')}; add one of them, or drop {f('calib_data')} for {f('method')} "
                f"{self.method}."
            )
        if paths and self.calib_data and not Path(self.calib_data).expanduser().is_file():
            p.add(f"{f('calib_data')} {self.calib_data} does not exist or is not a file.")
        if self.refine_steps > 0 and method is not None and method.fresh:
            p.add(
                f"{f('refine_steps')} cannot start from {f('method')} {self.method} (the blocks would be "
                f"trained from scratch on a few thousand tokens); use {f('method')} calibrated or mean."
            )
        if (
            grouping is not None
            and grouping.needs_calibration
            and method is not None
            and method.merge is None
        ):
            p.add(
                f"{f('grouping')} {self.grouping} cannot be combined with {f('method')} {self.method}; use "
                f"one of {', '.join(MERGE_METHODS)}."
            )


def check_groups(geom: AttentionGeometry, groups: int) -> None:
    """Raise a clear error unless pooling ``geom``'s K/V heads into ``groups`` heads is possible."""
    flag = Problems("convert").flag("groups")
    if groups <= 0:
        raise GqakitError(f"{flag} must be a positive number of K/V heads, got {groups}.")
    valid = ", ".join(map(str, geom.valid_groups()))
    if groups > geom.num_kv_heads:
        raise GqakitError(
            f"{flag} {groups} is more than the {geom.num_kv_heads} K/V heads this checkpoint has; pooling "
            f"cannot add heads. Valid {flag}: {valid}. To get more K/V heads, run `gqakit expand SRC DST` "
            f"first (it gives {geom.num_heads}, exactly equivalent) and convert that."
        )
    if geom.num_kv_heads % groups:
        raise GqakitError(
            f"{flag} {groups} does not divide the {geom.num_kv_heads} K/V heads of this checkpoint. "
            f"Valid {flag}: {valid}."
        )
