"""The conversion methods and head groupings: every name ``--method`` and ``--grouping`` take, defined once.

:data:`METHODS` maps each method to what it does: how it pools a group of K/V heads (the plan of
``gqakit convert`` without calibration), how it fits a merge from calibration statistics (the merge path:
``calibrated``, and ``--grouping similarity`` with ``mean`` or ``first``), whether it needs calibration
text, and whether it is one of the GQA paper's (Ainslie et al. 2023). The CLI's choices and help, the
recipe checks, ``gqakit probe`` and ``gqakit replicate`` all read these tables; :func:`fit_merge` and
:func:`gqakit.convert.plan.regroup` dispatch through them. A new method is one entry here and its pure
functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gqakit.convert.merge import Merge, first_merge, fit_key_merge, fit_value_merge, mean_merge
from gqakit.names import NameTable

# One group's heads ``[groups, r, ...]`` -> the pooled heads ``[groups, ...]``.
Pool = Callable[[torch.Tensor], torch.Tensor]
# ("key" | "value", heads ``[r, d, m]``, gram ``[m, m]``, rotary channels) -> the group's merge.
MergeFit = Callable[[str, torch.Tensor, torch.Tensor, int], Merge]


@dataclass(frozen=True)
class ConvertMethod:
    """What one ``--method`` does.

    Attributes:
        summary: one line for help texts and docs.
        pool: pools each group of heads in the plain (uncalibrated) plan; None when the method has no
            pooling form (it must be fitted).
        merge: fits the group's merge from calibration statistics; None when the method has no merge
            form (``random`` ignores the weights, so there is nothing to fit or regroup by).
        fresh: the heads are drawn anew instead of pooled (``random``).
        needs_calibration: needs ``--calib-data``.
        paper: one of the GQA paper's conversions.
    """

    summary: str
    pool: Pool | None = None
    merge: MergeFit | None = None
    fresh: bool = False
    needs_calibration: bool = False
    paper: bool = False


def _mean_pool(grouped: torch.Tensor) -> torch.Tensor:
    # summed in float32 straight from the stored dtype: no float32 copy of the whole tensor first
    return grouped.sum(dim=1, dtype=torch.float32) / grouped.shape[1]


def _first_pool(grouped: torch.Tensor) -> torch.Tensor:
    return grouped[:, 0]


def _calibrated_fit(kind: str, w: torch.Tensor, gram: torch.Tensor, rotary_dim: int) -> Merge:
    return fit_key_merge(w, gram, rotary_dim) if kind == "key" else fit_value_merge(w, gram)


METHODS: NameTable[ConvertMethod] = NameTable(
    "conversion method",
    {
        "mean": ConvertMethod(
            "average each group's K/V heads (the GQA paper's)",
            _mean_pool,
            lambda kind, w, gram, rotary_dim: mean_merge(w.shape[0], w.shape[1]),
            paper=True,
        ),
        "first": ConvertMethod(
            "keep each group's first head",
            _first_pool,
            lambda kind, w, gram, rotary_dim: first_merge(w.shape[0], w.shape[1]),
            paper=True,
        ),
        "random": ConvertMethod("fresh initialisation, ignoring the weights", fresh=True, paper=True),
        "calibrated": ConvertMethod(
            "merge each group to fit its outputs on --calib-data (errors weighted by the queries and "
            "o_proj columns that read them) and fold the difference into q_proj and o_proj",
            merge=_calibrated_fit,
            needs_calibration=True,
        ),
    },
)
# The methods with a pooling form (the plain plan) and those with a merge form (calibrated, and what
# --grouping similarity can combine with).
POOLING_METHODS: tuple[str, ...] = METHODS.where(lambda m: m.pool is not None or m.fresh)
MERGE_METHODS: tuple[str, ...] = METHODS.where(lambda m: m.merge is not None)
PAPER_METHODS: tuple[str, ...] = METHODS.where(lambda m: m.paper)


@dataclass(frozen=True)
class Grouping:
    """What one ``--grouping`` does: ``summary`` for help texts; ``needs_calibration``: the groups are
    chosen from calibration statistics (it goes through the merge path)."""

    summary: str
    needs_calibration: bool = False


GROUPINGS: NameTable[Grouping] = NameTable(
    "grouping",
    {
        "contiguous": Grouping("heads g*r..g*r+r-1 share a group (what repeat_kv implies)"),
        "similarity": Grouping(
            "choose equal-sized groups by the merge's error on --calib-data and reorder whole heads to match",
            needs_calibration=True,
        ),
    },
)


def needs_calibration(method: str, grouping: str) -> bool:
    """True when ``method`` or ``grouping`` needs calibration statistics, i.e. the conversion goes through
    the merge path (unknown names need nothing; their own check reports them)."""
    m, g = METHODS.get(method), GROUPINGS.get(grouping)
    return bool(m and m.needs_calibration) or bool(g and g.needs_calibration)


def fit_merge(kind: str, method: str, w: torch.Tensor, gram: torch.Tensor, rotary_dim: int = 0) -> Merge:
    """The merge of ``method`` (one of :data:`MERGE_METHODS`) for the key or value heads ``w``."""
    fit = METHODS[method].merge if method in METHODS else None
    if fit is None:
        raise ValueError(f"{method!r} has no merge form; choose one of {', '.join(MERGE_METHODS)}")
    return fit(kind, w, gram, rotary_dim)


__all__ = [
    "GROUPINGS",
    "MERGE_METHODS",
    "METHODS",
    "PAPER_METHODS",
    "POOLING_METHODS",
    "ConvertMethod",
    "Grouping",
    "MergeFit",
    "Pool",
    "fit_merge",
    "needs_calibration",
]
