"""What a command shows on the terminal besides its own lines: progress bars, and no library chatter."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm


def progress(
    iterable: Iterable[Any] | None = None,
    desc: str = "",
    total: float | None = None,
    enabled: bool = True,
    unit: str = "it",
    leave: bool = False,
    **kwargs: Any,
) -> tqdm:
    """A progress bar on stderr, the same for every command.

    Args:
        iterable: what to iterate over, or None for a bar advanced with ``update``.
        desc: the bar's label (``convert -> G=2``).
        total: the number of units; default ``len(iterable)``.
        enabled: False draws nothing (``--no-progress``, a process other than the main one).
        unit: what one step is; ``"B"`` counts bytes and shows them scaled (MB, GB).
        leave: keep the finished bar on the terminal (a long run's record of its speed).
        kwargs: any other ``tqdm`` argument (``initial``, ``smoothing``).
    """
    kwargs.setdefault("unit_scale", unit == "B")
    return tqdm(
        iterable, desc=desc, total=total, disable=not enabled, unit=unit, leave=leave, dynamic_ncols=True,
        **kwargs,
    )  # fmt: skip


def quiet_transformers() -> None:
    """Silence transformers' and datasets' warnings and progress bars: a command prints its own steps."""
    # deferred: transformers and datasets take seconds to import
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    datasets.logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
