"""The conversion methods: every name ``--method`` takes, defined once.

:data:`METHODS` maps each method to what it does: how it pools a group of K/V heads (the plan of
``gqakit convert`` without calibration), whether it needs calibration text (``calibrated``: the merge of
:mod:`gqakit.convert.merge_fit`), and whether it is one of the GQA paper's (Ainslie et al. 2023). The
CLI's choices and help, the recipe checks, ``gqakit probe`` and ``gqakit replicate`` all read this table.
A new method is one entry here and its pure functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gqakit.names import NameTable

# One group's heads ``[groups, r, ...]`` -> the pooled heads ``[groups, ...]``.
Pool = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ConvertMethod:
    """What one ``--method`` does.

    Attributes:
        summary: one line for help texts and docs.
        pool: pools each group of heads in the plain (uncalibrated) plan; None when the method has no
            pooling form (it must be fitted).
        fresh: the heads are drawn anew instead of pooled (``random``).
        needs_calibration: needs ``--calib-data``.
        paper: one of the GQA paper's conversions.
    """

    summary: str
    pool: Pool | None = None
    fresh: bool = False
    needs_calibration: bool = False
    paper: bool = False


def _mean_pool(grouped: torch.Tensor) -> torch.Tensor:
    # summed in float32 straight from the stored dtype: no float32 copy of the whole tensor first
    return grouped.sum(dim=1, dtype=torch.float32) / grouped.shape[1]


METHODS: NameTable[ConvertMethod] = NameTable(
    "conversion method",
    {
        "mean": ConvertMethod("average each group's K/V heads (the GQA paper's)", _mean_pool, paper=True),
        "first": ConvertMethod("keep each group's first head", lambda grouped: grouped[:, 0], paper=True),
        "random": ConvertMethod("fresh initialisation, ignoring the weights", fresh=True, paper=True),
        "calibrated": ConvertMethod(
            "merge each group to fit its outputs on --calib-data (errors weighted by the queries and "
            "o_proj columns that read them) and fold the difference into q_proj and o_proj",
            needs_calibration=True,
        ),
    },
)
# The methods with a pooling form (the plain plan) and the GQA paper's.
POOLING_METHODS: tuple[str, ...] = METHODS.where(lambda m: m.pool is not None or m.fresh)
PAPER_METHODS: tuple[str, ...] = METHODS.where(lambda m: m.paper)


__all__ = ["METHODS", "PAPER_METHODS", "POOLING_METHODS", "ConvertMethod", "Pool"]
