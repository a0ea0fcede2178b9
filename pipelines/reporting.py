"""What every pipeline's report uses: figures written to files, and numbers formatted for tables."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: reports write PNG files, also on machines with no
    display, and importing matplotlib is deferred until a report is drawn."""
    # deferred: matplotlib takes a second to import
    import matplotlib

    matplotlib.use("Agg")
    # deferred: matplotlib takes a second to import
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (the format follows the suffix) and close it, freeing its memory."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def fmt_ppl(ppl: float) -> str:
    """A perplexity for a table: two decimals below 1000, none above, ``inf`` when it overflowed."""
    if not math.isfinite(ppl):
        return "inf"
    return f"{ppl:,.2f}" if ppl < 1000 else f"{ppl:,.0f}"


def fmt_duration(seconds: float) -> str:
    """``42 s`` below a minute and a half, ``3.5 min`` above."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def wall_time(elapsed_s: float, reused: int, compute_s: float, unknown: int = 0) -> str:
    """A report's wall-time sentence: this run's time and how many results it reused, and, when it
    reused some, what computing the figures took (the results' own recorded times, summed).

    Args:
        elapsed_s: this run's wall time.
        reused: results reused from the working directory.
        compute_s: the recorded compute times of the results the report shows, summed
            (:meth:`~gqakit.pipelines.store.ResultStore.compute_time`).
        unknown: how many of them were stored without a time (by a gqakit that did not record it).
    """
    text = f"{fmt_duration(elapsed_s)} ({reused} results reused from the working directory)"
    # a run that computed (nearly) everything took about its own time: one figure says it
    if reused and (compute_s > elapsed_s + 1 or unknown):
        took = fmt_duration(compute_s)
        if unknown:
            took = (
                f"at least {took} ({unknown} of the results were stored by an older gqakit without their "
                "compute time; --fresh measures them all)"
            )
        text += f"; the runs that computed these figures took {took}"
    return text


__all__ = ["fmt_duration", "fmt_ppl", "pyplot", "save_figure", "wall_time"]
