"""The recovery pipeline: :func:`run_recovery` (see :mod:`gqakit.pipelines.recovery`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click

from gqakit.checkpoint import model_source, resolve_checkpoint
from gqakit.cli_options import click_options, options_from
from gqakit.convert import convert_checkpoint
from gqakit.convert.calibrate import CALIB_SEQ_LEN, calibration_ids, load_calibration_texts
from gqakit.convert.refine import check_sequences
from gqakit.convert.retarget import groups_problem, refusals
from gqakit.errors import GqakitError
from gqakit.families import family_of, get_adapter
from gqakit.models import load_tokenizer, max_positions
from gqakit.pipelines.recovery.curves import THRESHOLDS, Curve, eval_steps, tokens_to_reach
from gqakit.pipelines.recovery.options import BATCH_SIZE, EVAL_TOKENS, Inputs, RecoveryOptions
from gqakit.pipelines.recovery.report import write_recovery_report
from gqakit.pipelines.starts import conversion_key
from gqakit.pipelines.steps import Steps, pipeline_run, set_option, train_once, weights_key, wiki_splits
from gqakit.pipelines.store import ResultStore, fingerprint
from gqakit.problems import Problems, check_options
from gqakit.storage import atomic_output_dir
from gqakit.text import read_text_file
from gqakit.uptrain import read_history, recipe_from_dict, resolve_precision, validation_perplexity

SPLIT_EVERY = 20  # of every 20 documents of --data: one held out, one for calibration, 18 for training
PARTS = ("train", "calibration", "heldout")


@dataclass
class RecoveryResult:
    """What :func:`run_recovery` measured and wrote."""

    original_ppl: float
    curves: list[Curve]
    report: Path
    results_json: Path
    plot: Path
    elapsed_s: float


def split_text(o: RecoveryOptions) -> dict[str, list[str]]:
    """``--data`` split by document (line), in memory: of every 20, one held out, one for calibration,
    the rest trained on; interleaved, so each part samples the whole file."""
    docs = [line for line in read_text_file(o.data, "--data").splitlines() if line.strip()]
    parts: dict[str, list[str]] = {name: [] for name in PARTS}
    for i, doc in enumerate(docs):
        parts[{0: "heldout", SPLIT_EVERY // 2: "calibration"}.get(i % SPLIT_EVERY, "train")].append(doc)
    if not all(parts.values()):
        raise GqakitError(
            f"--data {o.data} has {len(docs)} non-empty lines (documents): too few to hold out one in "
            f"{SPLIT_EVERY} and calibrate on another; give a file with at least {SPLIT_EVERY} documents."
        )
    return parts


def check_inputs(o: RecoveryOptions) -> Inputs:
    """The source (fetched when it is an asset or a hub id: the cache is no output) and the text, with
    every check that needs them, before the working directory is created: the positions the runs need, a
    G the source cannot be converted to (convert's own message), a start a retargeted family cannot be
    converted with, and calibration text too short for a start that refines."""
    # the recipe of a run, --set applied: a bad key or value is refused before SRC is fetched
    placeholder = Inputs(o.src, Path("train.txt"), Path("calibration.txt"), Path("heldout.txt"))
    run_recipe(o, placeholder, "start", Path("out"))
    src = model_source(o.src, o.cache_dir)
    if o.data is None:
        train, calibration, heldout = wiki_splits(o)
        inputs = Inputs(src, train, calibration, heldout)
        calib_texts = load_calibration_texts(calibration)
    else:
        split = Path(o.work_dir).expanduser().resolve() / "data"
        inputs = Inputs(src, *(split / f"{name}.txt" for name in PARTS), split=split_text(o))
        calib_texts = inputs.split["calibration"]
    p = Problems("recovery")
    with resolve_checkpoint(src) as ckpt:
        limit = max_positions(SimpleNamespace(**ckpt.config))
        if limit is not None and o.seq_len > limit:
            p.add(
                f"--set data.seq_len {o.seq_len} is more than this model's {limit} positions (SRC {o.src}: "
                f"max_position_embeddings); use --set data.seq_len={limit} or less."
            )
        if family_of(ckpt.model_type).retarget is None:  # converted as it is: a family gqakit knows
            try:
                get_adapter(ckpt.model_type)
            except GqakitError as e:
                p.add(e.message)
        p.add(None if p else groups_problem(ckpt.config, o.groups))
        if not p:
            opts = [o.start_options(s, inputs.calibration) for s in o.starts]
            for problem in dict.fromkeys(m for opt in opts for m in refusals(ckpt, opt)):
                p.add(problem)  # each once, whichever starts share it
            refined = {opt.resolved().calib_tokens for opt in opts if opt.resolved().refine_steps}
            if refined and not p:
                tokenizer = load_tokenizer(ckpt.path)
                seq_len = min(CALIB_SEQ_LEN, limit or CALIB_SEQ_LEN)
                for tokens in refined:
                    check_sequences(calibration_ids(tokenizer, calib_texts, tokens, seq_len))
    p.raise_if_any("\n")
    return inputs


def write_split(inputs: Inputs, o: RecoveryOptions, store: ResultStore) -> None:
    """The checked parts of ``--data`` into the working directory (once per file and split)."""

    def build() -> None:
        with atomic_output_dir(inputs.train.parent, force=True) as tmp:
            for name, lines in inputs.split.items():
                (tmp / f"{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")

    key = {"data": fingerprint(Path(o.data).expanduser()), "every": SPLIT_EVERY}
    store.build_once(inputs.train.parent, key, build, name="data-split")


def recipe_data(o: RecoveryOptions, inputs: Inputs, model: str, out: Path) -> dict:
    """The uptraining recipe of one start (and of the original's reference evaluation), before ``--set``."""
    return {
        "model": {"path": model},
        "teacher": inputs.src if o.recipe_value("objective.kind", "distill") == "distill" else None,
        "data": {
            "files": [str(inputs.train)],
            "val_files": [str(inputs.heldout)],
            "seq_len": o.seq_len,
            "max_val_blocks": max(1, EVAL_TOKENS // o.seq_len),
        },
        "budget": {"steps": o.steps},
        "train": {
            "lr": o.lr,
            "weight_decay": 0.0,  # a repair run: do not pull the weights towards zero
            # a fixed warmup, then constant: the point at N tokens is what a run stopped there gives
            "warmup_fraction": o.warmup_fraction,
            "min_lr_ratio": 1.0,
            "batch_size": BATCH_SIZE,
            "precision": "auto",
        },
        "objective": {"kind": "distill"},
        "eval": {"every": 0, "at_start": True, "at_steps": eval_steps(o.steps, o.evals_per_decade)},
        "checkpoint": {"every": 25, "keep": 1},
        "speed": {"device": o.device},  # where the conversions run (auto: where accelerate puts it)
        "log": {"every": 1, "progress": o.progress},
        "output_dir": str(out),
        "seed": o.seed,
    }


def run_recipe(o: RecoveryOptions, inputs: Inputs, model: str, out: Path):
    """The recipe of one run: :func:`recipe_data` with ``--set`` applied and its precision resolved
    (``auto``: bf16 where the CPU or GPU has bf16 instructions, else fp32)."""
    recipe = recipe_from_dict(recipe_data(o, inputs, model, out), o.recipe_sets)
    recipe.train.precision = resolve_precision(recipe.train.precision, o.device)
    return recipe


def original_ppl(o: RecoveryOptions, store: ResultStore, inputs: Inputs) -> float:
    """The original's held-out perplexity, measured as each run measures its points."""
    recipe = run_recipe(o, inputs, inputs.src, Path("unused"))
    r = recipe.to_dict()
    # keyed by what the evaluation reads, not by the uptraining's rate, length or seed
    key = {
        "model": fingerprint(inputs.src) if Path(inputs.src).exists() else inputs.src,  # or a hub id
        "data": r["data"],
        "texts": inputs.texts("heldout"),
        "precision": r["train"]["precision"],
        "batch_size": [r["train"]["batch_size"], r["eval"].get("batch_size")],
    }

    def measure() -> dict:
        ppl, blocks = validation_perplexity(recipe, inputs.src)
        return {"ppl": ppl, "blocks": blocks}

    return float(store.value("original", key, measure)["ppl"])


def convert_start(
    o: RecoveryOptions, store: ResultStore, inputs: Inputs, start: str, models: Path
) -> tuple[Path, float]:
    """``src`` converted to ``start`` (cached); its directory and the conversion's compute time."""
    opts = o.start_options(start, inputs.calibration)
    dst = models / f"start-{start}"
    source = fingerprint(inputs.src) if Path(inputs.src).exists() else inputs.src
    key = {"source": source, "options": conversion_key(opts)}
    if opts.needs_text:  # only a start that reads the calibration text depends on it
        key["texts"] = inputs.texts("calibration")
    name = "convert-" + start
    store.build_once(dst, key, lambda: convert_checkpoint(inputs.src, dst, opts, progress=o.progress), name)
    return dst, float(store.time_of(name) or 0.0)


def uptrain_start(
    o: RecoveryOptions, store: ResultStore, inputs: Inputs, start: str, start_dir: Path, runs: Path
) -> tuple[list[tuple[int, float]], float]:
    """One uptraining run of ``start``, evaluated on the held-out text at log-spaced steps; cached, and
    resumed from its last checkpoint when it was killed. Returns the curve and the run's compute time."""
    out = runs / start
    recipe = run_recipe(o, inputs, str(start_dir), out)
    key = {
        "start": fingerprint(start_dir),
        "recipe": weights_key(recipe.to_dict()),
        "texts": inputs.texts("train", "heldout"),
    }
    # the same recipe names the same paths, which a rebuilt split or conversion reuses: resume only a run
    # started after the start and the texts it reads were written
    inputs_read = [start_dir, inputs.train, inputs.heldout]
    summary, _ = train_once(store, "run-" + start, recipe, key, inputs=inputs_read)
    history = read_history(out)
    points = sorted({int(r["tokens"]): float(r["val_ppl"]) for r in history if "val_ppl" in r}.items())
    return points, float(summary["elapsed_s"])


def run_recovery(options: RecoveryOptions) -> RecoveryResult:
    """Convert SRC with each start, uptrain each on the same data and objective, and write the report.

    Args:
        options: the source, starts, data and runs; every problem with them (the ``--set`` recipe, the
            source's positions, G and family, the text) is reported before anything is written.

    Returns:
        A :class:`RecoveryResult`; the report is at ``result.report``.
    """
    o = check_options(options, "recovery")
    inputs = check_inputs(o)
    with pipeline_run(o) as (work, store):
        steps = Steps(3 + len(o.starts), o.echo)
        o.echo(
            f"gqakit recovery: {o.src} -> {o.groups} K/V heads from {', '.join(o.starts)}; {o.steps} steps x "
            f"{o.tokens_per_step:,} tokens = {o.steps * o.tokens_per_step:,} tokens per start; working "
            f"directory {work}"
        )
        with steps.step("Inputs: the original checkpoint, the groups, and the text split three ways"):
            if inputs.split:
                write_split(inputs, o, store)
        with steps.step("The original's held-out perplexity (the 1.0 line)"):
            original = original_ppl(o, store, inputs)
            steps.note(f"original: {original:,.3f}")
        curves = []
        for start in o.starts:
            with steps.step(f"Start {start!r}: convert, then uptrain {o.steps} steps at lr {o.lr:g}"):
                start_dir, convert_s = convert_start(o, store, inputs, start, work / "models")
                points, train_s = uptrain_start(o, store, inputs, start, start_dir, work / "runs")
                curve = Curve(start, points, convert_s, train_s)
                curve.reach = {t: tokens_to_reach(curve.ratios(original), t) for t in THRESHOLDS}
                steps.note(
                    f"{start}: {points[0][1]:,.2f} -> {points[-1][1]:,.2f} at {points[-1][0]:,} tokens "
                    f"({points[-1][1] / original:.3f}x the original)"
                )
                curves.append(curve)
        with steps.step("Report: recovery.png, report.md, results.json"):
            recipe = run_recipe(o, inputs, "start", Path("out"))
            report, results_json, plot = write_recovery_report(
                o, inputs, recipe, original, curves, steps.elapsed, store
            )
        o.echo(f"Report: {report}")
        return RecoveryResult(original, curves, report, results_json, plot, steps.elapsed)


@click.command("recovery")
@click.argument("src")
@click_options(RecoveryOptions, skip=("src",))
@set_option(
    "Override the runs' recipe (repeatable), e.g. --set data.seq_len=128, --set objective.kind=lm; "
    "model.convert.calib_tokens=... and model.convert.refine_* change the starts that use them."
)
def recovery_cmd(**kwargs: Any) -> None:
    """Convert SRC (a checkpoint directory, a hub id or an asset name such as smollm2-135m) to --groups
    K/V heads from each start, uptrain each on the same data, and report how many tokens each needs to
    reach 2x, 1.5x, 1.2x, 1.1x and 1.05x the original's held-out perplexity, and what each start saves
    over the first. Cached and resumable in --work-dir: a rerun takes seconds."""
    run_recovery(options_from(RecoveryOptions, kwargs))
