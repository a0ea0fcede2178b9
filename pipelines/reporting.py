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


__all__ = ["fmt_duration", "fmt_ppl", "pyplot", "save_figure"]
