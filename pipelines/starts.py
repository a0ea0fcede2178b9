"""The starts a pipeline can convert a model from: every conversion method, and the calibrated merge
followed by layer-wise refinement (``refined``). ``gqakit replicate`` converts its MQA arms from them,
``gqakit recovery`` draws one recovery curve per start."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from gqakit.convert.methods import METHODS
from gqakit.convert.options import ConvertOptions
from gqakit.names import NameTable

REFINED = "refined"
STARTS: NameTable[str] = NameTable(
    "start",
    {
        **{name: method.summary for name, method in METHODS.items()},
        REFINED: "calibrated, then layer-wise refinement (gqakit convert --refine-steps)",
    },
)


def start_convert_options(
    start: str,
    groups: int,
    *,
    calib_data: str | None,
    calib_tokens: int,
    refine_steps: int,
    device: str = "auto",
    seed: int = 0,
    refine: dict[str, Any] | None = None,
) -> ConvertOptions:
    """The ``gqakit convert`` options that make ``start`` with ``groups`` K/V heads.

    Args:
        start: a name of :data:`STARTS`.
        groups: K/V heads after conversion.
        calib_data: calibration text, used by the starts that calibrate.
        calib_tokens: calibration tokens.
        refine_steps: refinement steps per layer of the ``refined`` start (ignored by the others).
        device: where the calibrated conversions run.
        seed: the seed of ``random`` and of the refinement's batch order.
        refine: the ``refined`` start's other refinement options, by their
            :class:`~gqakit.convert.options.ConvertOptions` names (``refine_target``, ``refine_qk_lr``,
            ``refine_schedule``, ``refine_loss``); the others take none.
    """
    method = "calibrated" if start == REFINED else start
    return ConvertOptions(
        groups=groups,
        method=method,
        seed=seed,
        force=True,
        calib_data=calib_data if METHODS[method].needs_calibration else None,
        calib_tokens=calib_tokens,
        refine_steps=refine_steps if start == REFINED else 0,
        device=device,
        **((refine or {}) if start == REFINED else {}),
    )


# Defaults that changed after pipelines first cached conversions under :func:`conversion_key`, with the
# value the old keys were written against: a conversion made with the old default must miss, one made
# with the new default must not look like it.
_KEYED_DEFAULTS: dict[str, Any] = {"refine_qk_lr": None, "refine_loss": "relative"}


def conversion_key(opts: ConvertOptions) -> dict[str, Any]:
    """The cache key of a conversion: its options that can change its output and differ from their
    defaults, so an option added later, whose default keeps today's output, leaves cached conversions
    valid. Left out: ``force``, the calibration size of a conversion that reads no calibration text, and
    the refinement settings of one that is not refined (mean pooling stays cached when only the refined
    start's budget changes), and the seed of one that draws nothing at random (neither ``random`` heads
    nor the order of refinement batches)."""
    unused = {"force"}
    if not METHODS[opts.method].fresh and not opts.refine_steps:
        unused.add("seed")
    if opts.calib_data is None:
        unused.add("calib_tokens")
    if not opts.refine_steps:
        unused.update(f.name for f in fields(opts) if f.name.startswith("refine_"))
    key = {}
    for f in fields(opts):
        # the loss is keyed as used: None (the target's own) and the name it stands for are one output
        value = opts.refine_loss_used if f.name == "refine_loss" else getattr(opts, f.name)
        if f.name not in unused and value != _KEYED_DEFAULTS.get(f.name, f.default):
            key[f.name] = value
    return key


__all__ = ["REFINED", "STARTS", "conversion_key", "start_convert_options"]
