"""The starts a pipeline converts a model from, named as ``gqakit convert`` names them: a preset (``mean``,
``fast``, ``best``) or a method (``first``, ``random``, ``calibrated``). ``gqakit recovery`` draws one
curve per start, ``gqakit replicate`` converts its MQA arms from them, the demo's variants name one.

A pipeline's ``--set model.convert.FIELD=VALUE`` changes a conversion setting of every start that uses it
(``calib_tokens`` of the starts that read text, ``refine_*`` of those that refine), as a recipe's
``model.convert`` block would."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import yaml

from gqakit.convert import PRESETS, ConvertOptions
from gqakit.convert.methods import METHODS
from gqakit.names import NameTable
from gqakit.problems import Problems

METHOD_STARTS = ("first", "random", "calibrated")  # the methods that are no preset of their own
CONVERT = "model.convert."  # the --set prefix of the conversion settings
SETTABLE = ("calib_tokens", "refine_steps", "refine_target", "refine_lr", "refine_qk_lr")


# for --help: the summaries are in `gqakit convert --help` and docs/convert.md
STARTS_HELP = f"a convert preset ({', '.join(PRESETS)}) or method ({', '.join(METHOD_STARTS)})"
STARTS: NameTable[str] = NameTable(
    "start", {**{n: p.summary for n, p in PRESETS.items()}, **{m: METHODS[m].summary for m in METHOD_STARTS}}
)


def split_sets(sets: Sequence[str], p: Problems | None = None) -> tuple[dict[str, Any], list[str]]:
    """``--set`` items as (conversion settings by field, the other overrides as given). An unknown
    conversion field is a problem added to ``p`` (raised at once without one)."""
    convert: dict[str, Any] = {}
    other: list[str] = []
    problems = p if p is not None else Problems("")
    for item in sets:
        key, _, raw = item.partition("=")
        if not key.startswith(CONVERT):
            other.append(item)
        elif key[len(CONVERT) :] in SETTABLE:
            convert[key[len(CONVERT) :]] = yaml.safe_load(raw)
        else:
            problems.add(
                f"--set {item!r}: a pipeline sets {CONVERT}{', '.join(SETTABLE)} of its starts (the start "
                "names the preset or method, the pipeline the rest)."
            )
    if p is None:
        problems.raise_if_any()
    return convert, other


def convert_options_for(
    start: str,
    groups: int,
    *,
    calib_data: str | None,
    sets: Sequence[str] = (),
    device: str = "auto",
    seed: int = 0,
) -> ConvertOptions:
    """The ``gqakit convert`` options that make ``start`` with ``groups`` K/V heads.

    Args:
        start: a name of :data:`STARTS`.
        groups: K/V heads after conversion.
        calib_data: the calibration text, given to the starts that read text.
        sets: the pipeline's ``--set`` items; each ``model.convert.*`` setting goes to the starts that use it.
        device: where the calibrated conversions run.
        seed: the seed of ``random`` and of the refinement's batch order.
    """
    kind = {"preset": start} if start in PRESETS else {"method": start}
    opts = ConvertOptions(groups, **kind, device=device, seed=seed, force=True)
    r = opts.resolved()
    # a setting goes to the starts that use it: refine_* to those that refine, the rest to those reading text
    settings = split_sets(sets)[0]
    uses = {k: bool(r.refine_steps) if k.startswith("refine_") else r.needs_text for k in settings}
    opts = replace(opts, **{k: v for k, v in settings.items() if uses[k]})
    return replace(opts, calib_data=str(calib_data)) if opts.needs_text else opts


def conversion_key(opts: ConvertOptions) -> dict[str, Any]:
    """The cache key of a conversion: its resolved settings that can change its output (a preset keys as
    the settings it stands for). Left out: ``force``, ``device`` (rounding only), the calibration of one
    that reads no text, the refinement settings of one that is not refined, and the seed of one that draws
    nothing at random (neither ``random`` heads nor the order of refinement batches)."""
    r = opts.resolved()
    unused = {"force", "device", "preset"}
    if not METHODS[r.method].fresh and not r.refine_steps:
        unused.add("seed")
    if not r.needs_text:
        unused.update({"calib_data", "calib_tokens"})
    if not r.refine_steps:
        unused.update(f.name for f in fields(r) if f.name.startswith("refine_"))
    return {f.name: getattr(r, f.name) for f in fields(r) if f.name not in unused}
