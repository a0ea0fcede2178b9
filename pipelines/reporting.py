"""What every pipeline's report uses: figures written with Agg, numbers formatted for tables, Markdown
tables, the command line, and the report files written atomically."""

from __future__ import annotations

import json
import logging
import math
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gqakit.storage import make_dirs, write_json, write_text

WIDE = 10  # values whose largest is this many times their smallest get a log axis


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (PNG files, also on machines with no display), imported
    when a report is drawn, with matplotlib's notes (the font cache it builds on a first run) silenced."""
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    # deferred: matplotlib takes a second to import
    import matplotlib

    matplotlib.use("Agg")
    # deferred: matplotlib takes a second to import
    import matplotlib.pyplot as plt

    return plt


def log_if_wide(ax: Any, values: Sequence[float], axis: str = "y") -> bool:
    """Put ``axis`` of ``ax`` on a log scale when the positive ``values`` span :data:`WIDE` times or more
    (a 12.9 beside a 17,395 is a flat line on a linear axis); return whether it did."""
    finite = [v for v in values if v and v > 0 and math.isfinite(v)]
    wide = bool(finite) and max(finite) / min(finite) >= WIDE
    if wide:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    return wide


def kv_label(kv_heads: int, heads: int) -> str:
    """A model by its K/V heads, as the tables name it: ``MHA-9``, ``GQA-3``, ``MQA``."""
    if kv_heads == 1:
        return "MQA"
    return f"{'MHA' if kv_heads == heads else 'GQA'}-{kv_heads}"


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


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table: the first column left-aligned, the others (figures) right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def command_line(default: str) -> str:
    """The command this process runs, as a user would type it (``default`` outside the CLI)."""
    return "gqakit " + shlex.join(sys.argv[1:]) if sys.argv[1:] else default


def write_report(out: Path, text: str, results: dict[str, Any]) -> tuple[Path, Path]:
    """``out/report.md`` and ``out/results.json``, each written atomically; their paths."""
    make_dirs(out)
    report, results_json = out / "report.md", out / "results.json"
    write_text(report, text)
    write_json(results_json, json.loads(json.dumps(results, default=str)))  # paths and the like as text
    return report, results_json


def wall_time(elapsed_s: float, reused: int, compute_s: float) -> str:
    """A report's wall-time sentence: this run's time and how many results it reused, and, when it
    reused some, what computing the figures took (the results' own recorded times, summed:
    :meth:`~gqakit.pipelines.store.ResultStore.compute_time`)."""
    text = f"{fmt_duration(elapsed_s)} ({reused} results reused from the working directory)"
    # a run that computed (nearly) everything took about its own time: one figure says it
    if reused and compute_s > elapsed_s + 1:
        text += f"; the runs that computed these figures took {fmt_duration(compute_s)}"
    return text


def versions() -> dict[str, str]:
    """The versions a report states: gqakit's, torch's, transformers' and Python's."""
    # deferred: torch and transformers take seconds to import
    import torch
    import transformers

    from gqakit import __version__

    return {
        "gqakit": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
