"""What every pipeline run shares: its common options and their checks, one line per step on the terminal,
quiet libraries, and its working directory held with its result store."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from gqakit.assets import fetch_asset
from gqakit.cli_options import device_field, opt, progress_field
from gqakit.console import quiet_transformers
from gqakit.errors import GqakitError
from gqakit.pipelines.starts import split_sets
from gqakit.pipelines.store import ResultStore
from gqakit.problems import Problems, device_problem
from gqakit.storage import working_directory, writable_dir


def _stderr(message: str) -> None:
    click.echo(message, err=True)


WORK_DIR_HELP = (
    "Checkpoints and cached results of every step; the next run reuses what is still valid. One run at a "
    "time: a second run on it is refused."
)


def out_field(default: str, help: str = "Directory for report.md, results.json and the plots.") -> Any:
    """A pipeline's ``--out``: where its report goes."""
    return opt(Path(default), help)


def work_dir_field(default: str) -> Any:
    """A pipeline's ``--work-dir``: its checkpoints and cached results."""
    return opt(Path(default), WORK_DIR_HELP)


def at_least(p: Problems, options: Any, minimum: int, *names: str) -> None:
    """Add to ``p`` each of the fields ``names`` of ``options`` that is below ``minimum`` (None passes)."""
    for name in names:
        value = getattr(options, name)
        if value is not None and value < minimum:
            p.add(f"{p.flag(name)} must be at least {minimum}, got {value}.")


@dataclass(kw_only=True)
class PipelineOptions:
    """The options every cached pipeline takes (``demo``, ``replicate``, ``recovery``); each pipeline's
    options extend it and give ``out`` and ``work_dir`` their defaults.

    ``sets`` are the ``--set`` items (:func:`set_option`); ``cache_dir`` and ``wheelhouse`` are the asset
    cache and a wheel directory for offline machines (``$GQAKIT_CACHE`` and ``$GQAKIT_WHEELHOUSE`` on the
    command line); ``echo`` is where step lines go.
    """

    out: Path = out_field("report")
    work_dir: Path = work_dir_field("work")
    device: str = device_field()
    fresh: bool = opt(False, "Recompute everything instead of reusing --work-dir.")
    progress: bool = progress_field()
    sets: tuple[str, ...] = opt((), cli=False)  # --set, declared by the command (repeatable)
    cache_dir: Path | None = opt(None, cli=False)
    wheelhouse: Path | None = opt(None, cli=False)
    echo: Callable[[str], None] = opt(_stderr, cli=False)

    def check(self, p: Problems) -> None:
        """The problems every pipeline's options can have: the device, a ``--set`` conversion key no start
        takes, and ``--out`` in the working directory's place; each pipeline adds its own."""
        p.add(device_problem(self.device, p.flag("device")))
        split_sets(self.sets, p)
        if Path(self.out).resolve() == Path(self.work_dir).resolve():
            p.add(f"{p.flag('work_dir')} and {p.flag('out')} must differ.")
        for name in ("out", "work_dir"):  # a throw-away probe: nothing is left
            try:
                writable_dir(getattr(self, name), p.flag(name))
            except GqakitError as e:
                p.add(e.message)

    @property
    def recipe_sets(self) -> list[str]:
        """The ``--set`` items that change the uptraining recipe (the others change the conversions)."""
        return split_sets(self.sets)[1]


def set_option(help: str) -> Callable[[Any], Any]:
    """``--set KEY=VALUE`` (repeatable) into the ``sets`` field: recipe-style overrides, and
    ``model.convert.*`` keys for the conversions (:func:`gqakit.pipelines.starts.split_sets`)."""
    return click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=help)


class Steps:
    """Numbered step lines, one per step, and indented notes with what a step measured::

        [2/7] Evaluate the original model (GQA-3, 9 query heads)
              original (GQA-3): perplexity 15.93, 0.912 bits/byte (41 s)

    Args:
        total: the number of steps the pipeline announces (the ``N`` of ``[k/N]``).
        echo: where the lines go, e.g. ``lambda m: click.echo(m, err=True)``.

    Attributes:
        t0: when the run began (``time.perf_counter``), for :attr:`elapsed`.
    """

    def __init__(self, total: int, echo: Callable[[str], None]) -> None:
        self.total = total
        self.echo = echo
        self.n = 0
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        """Seconds since the run began: the report's wall time."""
        return time.perf_counter() - self.t0

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        """Announce the next step, then run the ``with`` body."""
        self.n += 1
        self.echo(f"[{self.n}/{self.total}] {title}")
        yield

    def note(self, text: str) -> None:
        """One indented line under the current step."""
        self.echo(f"      {text}")


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Only the pipeline's own lines while it runs: no transformers or datasets warnings and bars, and no
    INFO lines of the verbs it calls (they would repeat its step lines); warnings still show, and gqakit's
    own progress bars follow ``--progress``."""
    quiet_transformers()
    gqakit_log = logging.getLogger("gqakit")
    level = gqakit_log.level
    gqakit_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        gqakit_log.setLevel(level)


def wiki_splits(o: PipelineOptions) -> tuple[Path, Path, Path]:
    """The wiki-en asset's train, validation and test text (fetched once into the asset cache)."""
    wiki = fetch_asset("wiki-en", o.cache_dir, wheelhouse=o.wheelhouse)
    return wiki["train"], wiki["validation"], wiki["test"]


@contextmanager
def pipeline_run(o: PipelineOptions) -> Iterator[tuple[Path, ResultStore]]:
    """Hold ``o.work_dir`` (one run at a time), open its result store and quiet the libraries; yield the
    working directory, resolved, and the store. Only once every check has passed: holding the working
    directory writes into it."""
    with working_directory(o.work_dir) as work, quiet_libraries():
        yield work, ResultStore(work / "results", o.fresh)
