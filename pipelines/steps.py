"""Progress of a multi-step pipeline: ``[k/N] title`` when a step starts, ``done in X s`` when it ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Steps:
    """Numbered step lines, with each step's duration and indented notes.

    ::

        [2/7] Evaluate the original model (GQA-3, 9 query heads)
              original (GQA-3): perplexity 15.93, 0.912 bits/byte (41 s)
              done in 41.3 s

    Args:
        total: the number of steps the pipeline announces (the ``N`` of ``[k/N]``).
        echo: where the lines go, e.g. ``lambda m: click.echo(m, err=True)``.
    """

    def __init__(self, total: int, echo: Callable[[str], None]) -> None:
        self.total = total
        self.echo = echo
        self.n = 0

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        """Announce the next step, run the ``with`` body, then print how long it took."""
        self.n += 1
        t0 = time.perf_counter()
        self.echo(f"[{self.n}/{self.total}] {title}")
        yield
        self.echo(f"      done in {time.perf_counter() - t0:.1f} s")

    def note(self, text: str) -> None:
        """One indented line under the current step."""
        self.echo(f"      {text}")


def quiet_transformers() -> None:
    """Silence transformers' warnings and progress bars: a pipeline prints its own steps."""
    # deferred: transformers takes seconds to import
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


__all__ = ["Steps", "quiet_transformers"]
