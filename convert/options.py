"""Options of ``gqakit convert``: the presets, the typed dataclass that generates the command's options,
its validation, and the checks on G. A field a preset sets is None unless given: a field given
explicitly > the preset's > the default preset's (``mean``, the GQA paper's conversion).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.cli_options import opt
from gqakit.convert.methods import METHODS
from gqakit.convert.refine import REFINE_LR, REFINE_QK_LR, REFINE_TARGETS
from gqakit.dtypes import LOAD_DTYPES, safetensors_name
from gqakit.errors import GqakitError
from gqakit.geometry import AttentionGeometry
from gqakit.names import NameTable
from gqakit.problems import Problems, device_problem, rate_problem

# CLI dtype names -> safetensors dtype names (None: keep each tensor's own).
DTYPE_CHOICES: dict[str, str | None] = {"keep": None, **{n: safetensors_name(n) for n in LOAD_DTYPES[1:]}}
DTYPE_HELP = "Output dtype of floating tensors (pooling runs in float32)."  # convert's and expand's


@dataclass(frozen=True)
class Preset:
    """One conversion recipe: the values of the fields a preset sets (see :data:`PRESETS`).

    Attributes:
        summary: one line for ``--help``.
        method, calib_tokens, refine_steps, refine_target, refine_lr, refine_qk_lr: the
            :class:`ConvertOptions` fields of those names.
    """

    summary: str
    method: str
    calib_tokens: int = 4096
    refine_steps: int = 0
    refine_target: str = "attention"
    refine_lr: float = REFINE_LR
    refine_qk_lr: float = REFINE_QK_LR

    @property
    def needs_text(self) -> bool:
        """Whether this preset calibrates or refines on text (then, without ``calib_data``, on wiki-en)."""
        return METHODS[self.method].needs_calibration or self.refine_steps > 0


# The conversions gqakit recommends, by name (docs/convert.md#presets has what each costs and scores).
PRESETS: NameTable[Preset] = NameTable(
    "preset",
    {
        "mean": Preset("average each group's K/V heads (the GQA paper's); no text needed", "mean"),
        "fast": Preset(
            "calibrated merge on 4,096 tokens, then 200 refinement steps per layer fitting each attention "
            "block's output",
            "calibrated",
            refine_steps=200,
        ),
        "best": Preset(
            "calibrated merge on 49,152 tokens, then 1,600 refinement steps per layer fitting each decoder "
            "layer's output from the converted model's states (layer-corrective): the lowest perplexity "
            "measured",
            "calibrated",
            calib_tokens=49152,
            refine_steps=1600,
            refine_target="layer-corrective",
        ),
    },
)
DEFAULT_PRESET = "mean"
# The fields a preset sets (None in ConvertOptions: the preset's value).
PRESET_FIELDS = tuple(f.name for f in dataclasses.fields(Preset) if f.name != "summary")


@dataclass(frozen=True)
class ConvertOptions:
    """Options of ``gqakit convert`` (and a recipe's ``model.convert``); each field's help is its option's.

    Fields a preset sets are None unless given: :meth:`resolved` is the copy every conversion runs on.
    ``--set NAME=VALUE`` gives the fields declared ``cli="set"``.
    """

    groups: int = opt(help="K/V heads in the output (1 = MQA).", short="-g")
    preset: str | None = opt(
        None,
        f"The conversion, by name: {PRESETS.describe()}. Default: {DEFAULT_PRESET}.",
        choices=PRESETS.names,
    )
    method: str | None = opt(
        None,
        f"How each group's K/V heads become one (overrides the preset's): {METHODS.describe()}. Families "
        "that normalize keys per head fall back to mean for keys (gqakit.json: key_merge).",
        choices=METHODS.names,
    )
    calib_data: str | None = opt(
        None,
        "Calibration text (.txt, .jsonl, .parquet) for the calibrated merge and refinement. Default for a "
        "preset that needs text: the wiki-en asset's train split.",
    )
    calib_tokens: int | None = opt(None, "Calibration tokens to run (overrides the preset's).")
    refine_steps: int | None = opt(
        None,
        "Adam steps per layer fitting each converted block to the original's output on the calibration "
        "text, keeping each layer's best step on held-out text; 0: off (overrides the preset's).",
    )
    refine_target: str | None = opt(
        None, f"What each block is fitted to: {REFINE_TARGETS.describe()}.", cli="set"
    )
    refine_lr: float | None = opt(None, "Learning rate of the refinement.", cli="set")
    refine_qk_lr: float | None = opt(
        None, "Learning rate of the refinement's query/key side (q, k and their norms).", cli="set"
    )
    seed: int = opt(0, "Seed of --method random and of the refinement's batch order.", cli="set")
    dtype: str = opt("keep", DTYPE_HELP, choices=list(DTYPE_CHOICES))
    device: str = opt("auto", "Where to run: auto (CUDA when present), cpu, cuda:N.")
    force: bool = opt(False, "Replace DST if it exists and is not empty.")

    @property
    def preset_row(self) -> Preset:
        """The preset these options start from (the default one when none or an unknown one is named)."""
        return PRESETS.get(self.preset or DEFAULT_PRESET) or PRESETS[DEFAULT_PRESET]

    def resolved(self) -> ConvertOptions:
        """A copy with every field concrete: the field as given, else the preset's value, else its default."""
        given = {n: getattr(self, n) for n in PRESET_FIELDS}
        values = {n: getattr(self.preset_row, n) if v is None else v for n, v in given.items()}
        return dataclasses.replace(self, preset=self.preset or DEFAULT_PRESET, **values)

    @property
    def needs_text(self) -> bool:
        """Whether the resolved conversion reads calibration text (a calibrated merge or refinement)."""
        return self.merged or bool(self.resolved().refine_steps)

    @property
    def wiki_text(self) -> bool:
        """Whether the conversion calibrates on the wiki-en asset: it reads text, none is given, and a
        preset that needs text is named."""
        return self.needs_text and not self.calib_data and bool(self.preset) and self.preset_row.needs_text

    @property
    def merged(self) -> bool:
        """True when this conversion fits calibrated merges (:mod:`gqakit.convert.merge_fit`)."""
        method = METHODS.get(self.resolved().method)  # type: ignore[arg-type]
        return method is not None and method.needs_calibration

    @property
    def provenance(self) -> dict[str, Any]:
        """The preset and the resolved values of the fields it sets, for gqakit.json."""
        r = self.resolved()
        return {"preset": r.preset, "settings": {n: getattr(r, n) for n in PRESET_FIELDS}}

    def check(self, p: Problems, paths: bool = True) -> None:
        """Add every problem with these options to ``p``, each field named as ``p`` names it (a recipe
        names them ``model.convert.*``); ``paths``: whether ``calib_data`` must exist now."""
        f = p.flag
        if self.preset is not None:
            p.add(PRESETS.unknown(self.preset, f("preset")))
        o = self.resolved()
        if o.groups <= 0:
            p.add(f"{f('groups')} must be a positive number of K/V heads, got {o.groups}.")
        p.add(device_problem(o.device, f("device")))
        p.add(METHODS.unknown(o.method, f("method")))  # type: ignore[arg-type]
        if o.dtype not in DTYPE_CHOICES:
            p.add(f"{f('dtype')} {o.dtype!r} is unknown; choose one of {', '.join(DTYPE_CHOICES)}.")
        if o.calib_tokens <= 0:  # type: ignore[operator]
            p.add(f"{f('calib_tokens')} must be a positive number of tokens, got {o.calib_tokens}.")
        if o.refine_steps < 0:  # type: ignore[operator]
            p.add(f"{f('refine_steps')} must be 0 (off) or a positive step count, got {o.refine_steps}.")
        p.add(rate_problem(f("refine_lr"), o.refine_lr, REFINE_LR))  # type: ignore[arg-type]
        p.add(rate_problem(f("refine_qk_lr"), o.refine_qk_lr, REFINE_QK_LR))  # type: ignore[arg-type]
        p.add(REFINE_TARGETS.unknown(o.refine_target, f("refine_target")))  # type: ignore[arg-type]
        method = METHODS.get(o.method)  # type: ignore[arg-type]
        needs = [f"{f('method')} {o.method}"] if self.merged else []
        needs += [f("refine_steps")] if o.refine_steps > 0 else []  # type: ignore[operator]
        if needs and not self.calib_data and not self.wiki_text:
            verb = "needs" if len(needs) == 1 else "need"
            p.add(
                f"{' and '.join(needs)} {verb} calibration text: give {f('calib_data')} FILE (.txt, .jsonl "
                "or .parquet), e.g. the train split of `gqakit assets fetch wiki-en`."
            )
        if self.calib_data and not needs:
            p.add(
                f"{f('calib_data')} is only used by {f('method')} calibrated or {f('refine_steps')}; add one "
                f"of them, or drop {f('calib_data')} for {f('method')} {o.method}."
            )
        if paths and self.calib_data and not Path(self.calib_data).expanduser().is_file():
            p.add(f"{f('calib_data')} {self.calib_data} does not exist or is not a file.")
        if o.refine_steps > 0 and method is not None and method.fresh:  # type: ignore[operator]
            p.add(
                f"{f('refine_steps')} cannot start from {f('method')} {o.method} (the blocks would be "
                f"trained from scratch on a few thousand tokens); use {f('method')} calibrated or mean."
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
