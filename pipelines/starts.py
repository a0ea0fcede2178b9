"""The starts a pipeline can convert a model from: every conversion method, and the calibrated merge
followed by layer-wise refinement (``refined``). ``gqakit replicate`` converts its MQA arms from them,
``gqakit recovery`` draws one recovery curve per start."""

from __future__ import annotations

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
) -> ConvertOptions:
    """The ``gqakit convert`` options that make ``start`` with ``groups`` K/V heads.

    Args:
        start: a name of :data:`STARTS`.
        groups: K/V heads after conversion.
        calib_data: calibration text, used by the starts that calibrate.
        calib_tokens: calibration tokens.
        refine_steps: refinement steps per layer of the ``refined`` start (ignored by the others).
        device: where the calibrated conversions run.
        seed: the seed of ``random``.
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
    )


__all__ = ["REFINED", "STARTS", "start_convert_options"]
