"""The recovery pipeline: :func:`run_recovery` (see :mod:`gqakit.pipelines.recovery`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from gqakit.checkpoint import model_source, resolve_checkpoint
from gqakit.convert import convert_checkpoint
from gqakit.convert.calibrate import calibration_sequences
from gqakit.convert.refine import check_sequences
from gqakit.convert.retarget import groups_problem, refusals
from gqakit.errors import GqakitError
from gqakit.pipelines.recovery.curves import THRESHOLDS, Curve, eval_steps, tokens_to_reach
from gqakit.pipelines.recovery.options import (
    BATCH_SIZE,
    EVAL_TOKENS,
    Inputs,
    RecoveryOptions,
    start_options,
)
from gqakit.pipelines.recovery.report import write_recovery_report
from gqakit.pipelines.run_keys import train_once, weights_key
from gqakit.pipelines.starts import conversion_key
from gqakit.pipelines.steps import Steps, pipeline_run, wiki_splits
from gqakit.pipelines.store import ResultStore, fingerprint
from gqakit.storage import atomic_output_dir, writable_dir
from gqakit.uptrain import read_history, recipe_from_dict, resolve_precision, validation_perplexity

SPLIT_EVERY = 20  # of every 20 documents of --data: one held out, one for calibration, 18 for training


@dataclass
class RecoveryResult:
    """What :func:`run_recovery` measured and wrote."""

    original_ppl: float
    curves: list[Curve]
    report: Path
    results_json: Path
    plot: Path
    elapsed_s: float


def check_source(o: RecoveryOptions, src: str, calibration: Path) -> None:
    """Refuse what would fail in a later conversion, before the first one: a G the source cannot be
    converted to (convert's own message), a start a retargeted family cannot be converted with, and
    calibration text too short for a start that refines."""
    with resolve_checkpoint(src) as ckpt:
        problem = groups_problem(ckpt.config, o.groups)
        if problem:
            raise GqakitError(problem)
        opts = [start_options(o, s, calibration) for s in o.starts]
        found = [m for opt in opts for m in refusals(ckpt, opt)]
        if found:  # each problem once, whichever starts share it
            raise GqakitError("\n".join(dict.fromkeys(found)))
        for r in {opt.resolved().calib_tokens for opt in opts if opt.resolved().refine_steps}:
            check_sequences(calibration_sequences(ckpt, calibration, r))


def split_data(o: RecoveryOptions, store: ResultStore, work: Path) -> tuple[Path, Path, Path]:
    """(train, calibration, held-out) text: the wiki-en asset's train / validation / test splits, or
    ``--data`` split by document (line): of every 20, one held out, one for calibration, the rest trained
    on; interleaved, so each part samples the whole file."""
    if o.data is None:
        return wiki_splits(o)
    data = Path(o.data).expanduser()
    dst = work / "data"

    def build() -> None:
        docs = [line for line in data.read_text(encoding="utf-8").splitlines() if line.strip()]
        parts: dict[str, list[str]] = {"train.txt": [], "calibration.txt": [], "heldout.txt": []}
        for i, doc in enumerate(docs):
            name = {0: "heldout.txt", SPLIT_EVERY // 2: "calibration.txt"}.get(i % SPLIT_EVERY, "train.txt")
            parts[name].append(doc)
        if not all(parts.values()):
            raise GqakitError(
                f"--data {o.data} has {len(docs)} non-empty lines (documents): too few to hold out one in "
                f"{SPLIT_EVERY} and calibrate on another; give a file with at least {SPLIT_EVERY} documents."
            )
        with atomic_output_dir(dst, force=True) as tmp:
            for name, lines in parts.items():
                (tmp / name).write_text("\n".join(lines) + "\n", encoding="utf-8")

    store.build_once(dst, {"data": fingerprint(data), "every": SPLIT_EVERY}, build, name="data-split")
    return dst / "train.txt", dst / "calibration.txt", dst / "heldout.txt"


def recipe_data(o: RecoveryOptions, inputs: Inputs, model: str, out: Path, lr: float) -> dict:
    """The uptraining recipe of one start (and of the original's reference evaluation), before ``--set``."""
    return {
        "model": {"path": model},
        "teacher": inputs.src if o.recipe_value("objective.kind", "distill") == "distill" else None,
        "data": {
            "files": [str(inputs.train)],
            "val_files": [str(inputs.heldout)],
            "txt_docs": "line",
            "seq_len": o.seq_len,
            "max_val_blocks": max(1, EVAL_TOKENS // o.seq_len),
        },
        "budget": {"steps": o.steps},
        "train": {
            "lr": lr,
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
        "log": {"every": 1, "progress": o.progress, "tensorboard": False},
        "output_dir": str(out),
        "seed": o.seed,
    }


def run_recipe(o: RecoveryOptions, inputs: Inputs, model: str, out: Path, lr: float):
    """The recipe of one run: :func:`recipe_data` with ``--set`` applied and its precision resolved
    (``auto``: bf16 where the CPU or GPU has bf16 instructions, else fp32)."""
    recipe = recipe_from_dict(recipe_data(o, inputs, model, out, lr), o.recipe_sets)
    recipe.train.precision = resolve_precision(recipe.train.precision, o.device)
    return recipe


def original_ppl(o: RecoveryOptions, store: ResultStore, inputs: Inputs) -> float:
    """The original's held-out perplexity, measured as each run measures its points."""
    recipe = run_recipe(o, inputs, inputs.src, Path("unused"), o.lr)
    r = recipe.to_dict()
    # keyed by what the evaluation reads, not by the uptraining's rate, length or seed
    key = {
        "model": _fingerprint(inputs.src),
        "data": r["data"],
        "texts": inputs.texts("heldout"),
        "precision": r["train"]["precision"],
        "batch_size": [r["train"]["batch_size"], r["eval"].get("batch_size")],
    }
    cached = store.get("original", key)
    if cached is None:
        ppl, blocks = validation_perplexity(recipe, inputs.src)
        cached = {"ppl": ppl, "blocks": blocks}
        store.put("original", key, cached)
    return float(cached["ppl"])


def _fingerprint(src: str) -> str:
    return fingerprint(src) if Path(src).exists() else src


def convert_start(
    o: RecoveryOptions, store: ResultStore, inputs: Inputs, start: str, models: Path
) -> tuple[Path, float]:
    """``src`` converted to ``start`` (cached); its directory and the conversion's compute time."""
    opts = start_options(o, start, inputs.calibration)
    dst = models / f"start-{start}"
    key = {"source": _fingerprint(inputs.src), "options": conversion_key(opts)}
    if opts.needs_text:  # only a start that reads the calibration text depends on it
        key["texts"] = inputs.texts("calibration")
    name = "convert-" + start
    cached = store.get_output(name, key, dst)
    if cached is None:
        t0 = time.perf_counter()
        convert_checkpoint(inputs.src, dst, opts, progress=o.progress)
        cached = store.put_output(name, key, dst, {"elapsed_s": time.perf_counter() - t0})
    return dst, float(store.time_of(name) or cached["elapsed_s"])


def run_name(o: RecoveryOptions, start: str, lr: float) -> str:
    """The name of one uptraining run's folder and cache entry: the start, and its rate where the start
    has several (a start with one rate keeps the name, and the cache, of a run without a sweep)."""
    return f"{start}-lr{lr:g}" if o.swept(start) else start


def uptrain_start(
    o: RecoveryOptions, store: ResultStore, inputs: Inputs, start: str, start_dir: Path, runs: Path, lr: float
) -> tuple[list[tuple[int, float]], float]:
    """One uptraining run of ``start`` at peak rate ``lr``, evaluated on the held-out text at log-spaced
    steps; cached, and resumed from its last checkpoint when it was killed. Returns the curve and the run's
    compute time."""
    name = run_name(o, start, lr)
    out = runs / name
    recipe = run_recipe(o, inputs, str(start_dir), out, lr)
    key = {
        "start": fingerprint(start_dir),
        "recipe": weights_key(recipe.to_dict()),
        "texts": inputs.texts("train", "heldout"),
    }
    # the same recipe names the same paths, which a rebuilt split or conversion reuses: resume only a run
    # started after the start and the texts it reads were written
    inputs_read = [start_dir, inputs.train, inputs.heldout]
    summary, _ = train_once(store, "run-" + name, recipe, key, fresh=o.fresh, inputs=inputs_read)
    history = read_history(out)
    points = sorted({int(r["tokens"]): float(r["val_ppl"]) for r in history if "val_ppl" in r}.items())
    return points, float(summary["elapsed_s"])


def run_recovery(options: RecoveryOptions) -> RecoveryResult:
    """Convert SRC with each start, uptrain each on the same data and objective, and write the report.

    Args:
        options: the source, starts, data and runs; every problem with them (the ``--set`` recipe
            included) is reported before any conversion.

    Returns:
        A :class:`RecoveryResult`; the report is at ``result.report``.
    """
    o = options
    o.validate()
    placeholder = Inputs("src", Path("train.txt"), Path("calibration.txt"), Path("heldout.txt"))
    run_recipe(o, placeholder, "start", Path("out"), o.lr)  # a bad --set, before any step
    writable_dir(o.out, "--out")
    writable_dir(o.work_dir, "--work-dir")
    with pipeline_run(o) as (work, store):
        return _recover(o, work, store)


def _recover(o: RecoveryOptions, work: Path, store: ResultStore) -> RecoveryResult:
    """:func:`run_recovery` once its options are valid and it holds the working directory ``work``."""
    t_start = time.perf_counter()
    steps = Steps(3 + len(o.starts), o.echo)
    o.echo(
        f"gqakit recovery: {o.src} -> {o.groups} K/V heads from {', '.join(o.starts)}; {o.steps} steps x "
        f"{o.tokens_per_step:,} tokens = {o.steps * o.tokens_per_step:,} tokens per start; working "
        f"directory {work}"
    )
    with steps.step("Inputs: the original checkpoint, the groups, and the text split three ways"):
        src = model_source(o.src, o.cache_dir, o.wheelhouse)
        inputs = Inputs(src, *split_data(o, store, work))
        check_source(o, src, inputs.calibration)
    with steps.step("The original's held-out perplexity (the 1.0 line)"):
        original = original_ppl(o, store, inputs)
        steps.note(f"original: {original:,.3f}")
    curves = []
    for start in o.starts:
        rates = o.rates_of(start)
        at = f"lr {rates[0]:g}" if len(rates) == 1 else f"each of lr {', '.join(f'{lr:g}' for lr in rates)}"
        with steps.step(f"Start {start!r}: convert, then uptrain {o.steps} steps at {at}"):
            start_dir, convert_s = convert_start(o, store, inputs, start, work / "models")
            for lr in rates:
                points, train_s = uptrain_start(o, store, inputs, start, start_dir, work / "runs", lr)
                curve = Curve(start, lr, points, convert_s, train_s, swept=len(rates) > 1)
                curve.reach = {t: tokens_to_reach(curve.ratios(original), t) for t in THRESHOLDS}
                steps.note(
                    f"{curve.label}: {points[0][1]:,.2f} -> {points[-1][1]:,.2f} at {points[-1][0]:,} tokens "
                    f"({points[-1][1] / original:.3f}x the original)"
                )
                curves.append(curve)
    with steps.step("Report: recovery.png, report.md, results.json"):
        elapsed = time.perf_counter() - t_start
        recipe = run_recipe(o, inputs, "start", Path("out"), o.lr)
        report, results_json, plot = write_recovery_report(
            o, inputs, recipe, original, curves, elapsed, store
        )
    o.echo(f"Report: {report}")
    return RecoveryResult(original, curves, report, results_json, plot, elapsed)


__all__ = ["RecoveryResult", "run_recovery"]
