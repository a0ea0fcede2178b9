"""What every pipeline run shares: its common options and their checks, one line per step on the terminal,
quiet libraries, its working directory held with its result store, its uptraining runs (:func:`train_once`),
cached and resumed, and its report (:func:`write_report`; figures drawn with :func:`gqakit.eval.plots.figure`
and tables with :func:`gqakit.eval.report.md_table`, as ``gqakit eval`` draws its own).

An uptraining run is cached and resumed by its recipe less what does not change the weights it trains:
``--no-progress`` sets ``log.progress``, and ``speed`` levers and the ``checkpoint`` cadence change how a
run goes, not what it trains; ``uptrain(resume=True)`` accepts all three (``RESUME_SAFE``). Keying or
resuming on the whole recipe would rerun an uptraining for a progress bar, or start a killed run over.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click
import torch
import yaml

from gqakit.assets import fetch_asset
from gqakit.cli_options import device_field, opt, progress_field
from gqakit.console import quiet_transformers
from gqakit.errors import GqakitError
from gqakit.eval.results import environment
from gqakit.models import cpu_model
from gqakit.pipelines.starts import split_sets
from gqakit.pipelines.store import ResultStore
from gqakit.problems import Problems, device_problem
from gqakit.storage import make_dirs, working_directory, writable_dir, write_json, write_text
from gqakit.uptrain import uptrain


def out_field(default: str, help: str = "Directory for report.md, results.json and the plots.") -> Any:
    """A pipeline's ``--out``: where its report goes."""
    return opt(Path(default), help)


def work_dir_field(default: str) -> Any:
    """A pipeline's ``--work-dir``: its checkpoints and cached results."""
    return opt(
        Path(default),
        "Checkpoints and cached results of every step; the next run reuses what is still valid. One run at "
        "a time: a second run on it is refused.",
    )


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

    ``sets`` are the ``--set`` items (:func:`set_option`); ``cache_dir`` is the asset cache
    (``$GQAKIT_CACHE`` on the command line, as the wheel directory is ``$GQAKIT_WHEELHOUSE``); ``echo`` is
    where step lines go.
    """

    out: Path = out_field("report")
    work_dir: Path = work_dir_field("work")
    device: str = device_field()
    fresh: bool = opt(False, "Recompute everything instead of reusing --work-dir.")
    progress: bool = progress_field()
    sets: tuple[str, ...] = opt((), cli=False)  # --set, declared by the command (repeatable)
    cache_dir: Path | None = opt(None, cli=False)
    echo: Callable[[str], None] = opt(partial(click.echo, err=True), cli=False)

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
    """Numbered step lines, one per step (``total`` is the ``N`` of ``[k/N]``), and indented notes with
    what a step measured, each to ``echo``::

        [2/7] Evaluate the original model (GQA-3, 9 query heads)
              original (GQA-3): perplexity 15.93, 0.912 bits/byte (41 s)
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


def wiki_splits(o: PipelineOptions) -> tuple[Path, Path, Path]:
    """The wiki-en asset's train, validation and test text (fetched once into the asset cache)."""
    wiki = fetch_asset("wiki-en", o.cache_dir)
    return wiki["train"], wiki["validation"], wiki["test"]


@contextmanager
def pipeline_run(o: PipelineOptions) -> Iterator[tuple[Path, ResultStore]]:
    """Hold ``o.work_dir`` (one run at a time) and open its result store; yield the working directory,
    resolved, and the store. Only once every check has passed: holding the working directory writes into
    it.

    While it runs, only the pipeline's own lines show: no transformers or datasets warnings and bars, and
    no INFO lines of the verbs it calls (they would repeat its step lines); warnings still show, and
    gqakit's own progress bars follow ``--progress``."""
    with working_directory(o.work_dir) as work:
        quiet_transformers()
        gqakit_log = logging.getLogger("gqakit")
        level = gqakit_log.level
        gqakit_log.setLevel(logging.WARNING)
        try:
            yield work, ResultStore(work / "results", o.fresh)
        finally:
            gqakit_log.setLevel(level)


NOT_WEIGHTS = ("log", "speed", "checkpoint")  # recipe sections that leave the trained weights as they are


def weights_key(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe (``Recipe.to_dict()``, or a run's ``recipe.yaml`` loaded) less :data:`NOT_WEIGHTS`."""
    return {k: v for k, v in recipe.items() if k not in NOT_WEIGHTS}


def same_run(out: Path, recipe) -> bool:
    """Whether the run directory ``out`` holds a run of ``recipe`` (its ``recipe.yaml``) up to
    :data:`NOT_WEIGHTS`: a run killed under ``--progress`` resumes under ``--no-progress`` instead of
    starting over."""
    saved = out / "recipe.yaml"
    if not saved.is_file():
        return False
    try:
        before = yaml.safe_load(saved.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        return False  # not a recipe gqakit wrote: start over
    now = yaml.safe_load(recipe.to_yaml())  # as written, so types compare as they were saved
    return isinstance(before, dict) and weights_key(before) == weights_key(now)


def _started_after(started: Path, inputs: Sequence[Path]) -> bool:
    """True when the file ``started`` was written after every file of ``inputs`` (files or directories)."""
    files = [f for p in inputs for f in ([p] if p.is_file() else p.iterdir()) if f.is_file()]
    return all(f.stat().st_mtime_ns <= started.stat().st_mtime_ns for f in files)


def train_once(
    store: ResultStore,
    name: str,
    recipe,
    key: dict[str, Any],
    *,
    inputs: Sequence[Path] = (),
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Run ``recipe`` into its ``output_dir`` unless the same run finished there (cached in ``store`` as
    ``name`` under ``key``, and only while the directory is unchanged); a run killed before it finished
    resumes from its last checkpoint when its recipe is the same up to :data:`NOT_WEIGHTS` and it started
    after every one of ``inputs`` was written (a rebuilt start or text under the same path starts over);
    never under ``--fresh`` (``store.fresh``).

    Returns:
        The run's summary (``extra`` included; ``elapsed_s`` its recorded compute time) and whether it was
        reused.
    """
    out = Path(recipe.output_dir)
    cached = store.get(name, key, out)
    reused = cached is not None
    if not reused:
        resume = (
            same_run(out, recipe)
            and not (out / "gqakit.json").is_file()
            and not store.fresh
            and _started_after(out / "recipe.yaml", inputs)
        )
        res = uptrain(recipe, resume=resume, force=not resume)
        summary = {
            "steps": int(res.steps),
            "tokens": int(res.tokens),
            "alpha": res.alpha,
            "initial_val_ppl": res.initial_val_ppl,
            "final_val_ppl": res.final_val_ppl,
            "metrics": str(res.history),
            **(extra or {}),
        }
        cached = store.put(name, key, summary, out)
    return {**cached, "elapsed_s": round(store.time_of(name) or 0.0, 1)}, reused


def kv_label(kv_heads: int, heads: int) -> str:
    """A model by its K/V heads, as the tables name it: ``MHA-9``, ``GQA-3``, ``MQA``."""
    if kv_heads == 1:
        return "MQA"
    return f"{'MHA' if kv_heads == heads else 'GQA'}-{kv_heads}"


def fmt_ppl(ppl: float) -> str:
    """A perplexity for a table: two decimals below 1000, none above, ``inf`` when it overflowed."""
    if not math.isfinite(ppl):
        return "inf"
    return f"{ppl:,.2f}" if ppl < 1000 else f"{ppl:,.0f}"


def fmt_duration(seconds: float) -> str:
    """``42 s`` below a minute and a half, ``3.5 min`` above."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def command_line(default: str) -> str:
    """The command this process runs, as a user would type it (``default`` outside the CLI)."""
    return "gqakit " + shlex.join(sys.argv[1:]) if sys.argv[1:] else default


def write_report(
    out: Path, text: str, results: dict[str, Any], figures: dict[str, Any], command: str = ""
) -> tuple[Path, Path, list[Path]]:
    """The one way a pipeline writes its report into ``out``, each file atomically: ``figures`` (by file
    name), ``report.md`` (``text``, then a line with the command, the machine and the versions) and
    ``results.json`` (``results`` and the same); their paths."""
    make_dirs(out)
    plots = [out / name for name in figures]
    for fig, path in zip(figures.values(), plots, strict=True):
        fig.savefig(path, dpi=110)
    env = environment(torch.device("cpu"), command_line(command))  # the versions gqakit eval reports
    about = {
        "command": env["command_line"],
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "versions": {**env["versions"], "python": env["python"]},
    }
    text += (
        f"\nMachine-readable figures: `results.json`. Command: `{about['command']}`; machine: "
        f"{about['machine']}; {', '.join(f'{k} {v}' for k, v in about['versions'].items())}.\n"
    )
    report, results_json = out / "report.md", out / "results.json"
    write_text(report, text)
    # paths and the like as text
    write_json(results_json, json.loads(json.dumps({**results, **about}, default=str)))
    return report, results_json, plots


def wall_time(elapsed_s: float, reused: int, compute_s: float) -> str:
    """A report's wall-time sentence: this run's time and how many results it reused, and, when it
    reused some, what computing the figures took (the results' own recorded times, summed:
    :meth:`~gqakit.pipelines.store.ResultStore.compute_time`)."""
    text = f"{fmt_duration(elapsed_s)} ({reused} results reused from the working directory)"
    # a run that computed (nearly) everything took about its own time: one figure says it
    if reused and compute_s > elapsed_s + 1:
        text += f"; the runs that computed these figures took {fmt_duration(compute_s)}"
    return text
