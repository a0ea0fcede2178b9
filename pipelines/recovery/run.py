"""The recovery pipeline: :func:`run_recovery` (see :mod:`gqakit.pipelines.recovery`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from gqakit.assets import ASSETS, fetch_asset
from gqakit.checkpoint import resolve_checkpoint
from gqakit.convert import convert_checkpoint
from gqakit.convert.calibrate import calibration_sequences
from gqakit.convert.options import ConvertOptions, check_groups
from gqakit.convert.refine import check_sequences
from gqakit.convert.retarget import RETARGETS, retarget_groups_problem
from gqakit.convert.retarget_convert import retarget_problems
from gqakit.errors import GqakitError
from gqakit.geometry import AttentionGeometry
from gqakit.local_assets import BUILT
from gqakit.locks import working_directory
from gqakit.outputs import atomic_output_dir, writable_dir
from gqakit.pipelines.recovery.curves import THRESHOLDS, Curve, eval_steps, tokens_to_reach
from gqakit.pipelines.recovery.options import Inputs, RecoveryOptions
from gqakit.pipelines.recovery.report import write_report
from gqakit.pipelines.run_keys import same_run, weights_key
from gqakit.pipelines.starts import REFINED, conversion_key, start_convert_options
from gqakit.pipelines.steps import Steps, quiet_transformers
from gqakit.pipelines.store import ResultStore, fingerprint
from gqakit.uptrain import recipe_from_dict, uptrain, validation_perplexity
from gqakit.uptrain.metrics import read_history
from gqakit.uptrain.preflight import resolve_precision

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


def resolve_source(o: RecoveryOptions) -> str:
    """SRC as a checkpoint: a directory or hub id as given, or an asset's model (``smollm2-135m``,
    ``replicate-mha``)."""
    if not Path(o.src).expanduser().exists() and (o.src in ASSETS or o.src in BUILT):
        return str(fetch_asset(o.src, o.cache_dir, wheelhouse=o.wheelhouse)["model"])
    if o.src.endswith(".gguf"):
        raise GqakitError(
            f"SRC {o.src} is a GGUF file; the recovery runs need the checkpoint as a directory (it is the "
            "teacher and the reference): give its Hugging Face directory, e.g. the asset name smollm2-135m."
        )
    return str(Path(o.src).expanduser()) if Path(o.src).expanduser().exists() else o.src


def start_options(o: RecoveryOptions, start: str, calibration: Path) -> ConvertOptions:
    """The ``gqakit convert`` options of ``start`` in this recovery run."""
    return start_convert_options(
        start, o.groups, calib_data=str(calibration), calib_tokens=o.calib_tokens,
        refine_steps=o.refine_steps, device=o.device, seed=o.seed, refine=o.refine,
    )  # fmt: skip


def check_source(o: RecoveryOptions, src: str, calibration: Path) -> None:
    """Refuse what would fail in a later conversion, before the first one: a G the source cannot be
    converted to (convert's own message), a start a retargeted family cannot be converted with (e.g. a
    refinement target other than the attention output), and calibration text too short for the refined
    start."""
    with resolve_checkpoint(src) as ckpt:
        if ckpt.model_type in RETARGETS:
            problem = retarget_groups_problem(ckpt.config, o.groups)
            if problem:
                raise GqakitError(problem)
            retarget = RETARGETS[ckpt.model_type]
            found = [
                m
                for s in o.starts
                for m in retarget_problems(ckpt, retarget, start_options(o, s, calibration))
            ]
            if found:
                raise GqakitError(
                    "\n".join(dict.fromkeys(found))
                )  # each problem once, whichever starts share it
        else:
            check_groups(AttentionGeometry.from_config(ckpt.config), o.groups)
        if REFINED in o.starts:
            check_sequences(calibration_sequences(ckpt, calibration, o.calib_tokens))


def split_data(o: RecoveryOptions, store: ResultStore, work: Path) -> tuple[Path, Path, Path]:
    """(train, calibration, held-out) text: the wiki-en asset's train / validation / test splits, or
    ``--data`` split by document (line): of every 20, one held out, one for calibration, the rest trained
    on; interleaved, so each part samples the whole file."""
    if o.data is None:
        wiki = fetch_asset("wiki-en", o.cache_dir, wheelhouse=o.wheelhouse)
        return wiki["train"], wiki["validation"], wiki["test"]
    data = Path(o.data).expanduser()
    dst = work / "data"

    def build() -> None:
        docs = [line for line in data.read_text(encoding="utf-8").splitlines() if line.strip()]
        parts: dict[str, list[str]] = {"train.txt": [], "calibration.txt": [], "heldout.txt": []}
        for i, doc in enumerate(docs):
            name = {0: "heldout.txt", SPLIT_EVERY // 2: "calibration.txt"}.get(i % SPLIT_EVERY, "train.txt")
            parts[name].append(doc)
        empty = [name for name, lines in parts.items() if not lines]
        if empty:
            raise GqakitError(
                f"--data {o.data} has {len(docs)} non-empty lines (documents): too few to hold out one in "
                f"{SPLIT_EVERY} and calibrate on another; give a file with at least {SPLIT_EVERY} documents."
            )
        with atomic_output_dir(dst, force=True) as tmp:
            for name, lines in parts.items():
                (tmp / name).write_text("\n".join(lines) + "\n", encoding="utf-8")

    store.build_once(dst, {"data": fingerprint(data), "every": SPLIT_EVERY}, build, name="data-split")
    return dst / "train.txt", dst / "calibration.txt", dst / "heldout.txt"


def recipe_data(o: RecoveryOptions, inputs: Inputs, model: str, out: Path, lr: float, precision: str) -> dict:
    """The uptraining recipe of one start (and of the original's reference evaluation)."""
    steps = o.steps
    return {
        "model": {"path": model},
        "teacher": inputs.src if o.objective == "distill" else None,
        "data": {
            "files": [str(inputs.train)],
            "val_files": [str(inputs.heldout)],
            "txt_docs": "line",
            "seq_len": o.seq_len,
            "max_val_blocks": max(1, o.eval_tokens // o.seq_len),
        },
        "budget": {"steps": steps},
        "train": {
            "lr": lr,
            "weight_decay": 0.0,  # a repair run: do not pull the weights towards zero
            # a fixed warmup, then constant: the point at N tokens is what a run stopped there gives
            "warmup_fraction": o.warmup_fraction,
            "min_lr_ratio": 1.0,
            "batch_size": o.batch_size,
            "precision": precision,
        },
        "objective": {"kind": o.objective},
        "eval": {"every": 0, "at_start": True, "at_steps": eval_steps(steps, o.evals_per_decade)},
        "checkpoint": {"every": o.checkpoint_every, "keep": 1},
        "speed": {"device": o.device},  # where the conversions run (auto: where accelerate puts it)
        "log": {"every": 1, "progress": o.progress, "tensorboard": False},
        "output_dir": str(out),
        "seed": o.seed,
    }


def original_ppl(o: RecoveryOptions, store: ResultStore, inputs: Inputs, precision: str) -> float:
    """The original's held-out perplexity, measured as each run measures its points."""
    recipe = recipe_from_dict(recipe_data(o, inputs, inputs.src, Path("unused"), o.lr, precision))
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
    """``src`` converted to ``start`` (cached); its directory and the conversion's wall time (the time it
    recorded in the store, which includes what an attempt killed before it spent)."""
    opts = start_options(o, start, inputs.calibration)
    dst = models / f"start-{start}"
    key = {"source": _fingerprint(inputs.src), "options": conversion_key(opts)}
    if opts.calib_data is not None:  # only a start that reads the calibration text depends on it
        key["texts"] = inputs.texts("calibration")
    name = "convert-" + start
    cached = store.get_output(name, key, dst)
    if cached is None:
        t0 = time.perf_counter()
        convert_checkpoint(inputs.src, dst, opts, progress=o.progress)
        cached = store.put_output(name, key, dst, {"elapsed_s": time.perf_counter() - t0})
    recorded = store.time_of(name)  # None: stored before results recorded their time
    return dst, float(cached["elapsed_s"] if recorded is None else recorded)


def _started_after(started: Path, inputs: list[Path]) -> bool:
    """True when the file ``started`` was written after every file of ``inputs`` (files or
    directories)."""
    files = [f for p in inputs for f in ([p] if p.is_file() else p.iterdir()) if f.is_file()]
    return all(f.stat().st_mtime_ns <= started.stat().st_mtime_ns for f in files)


def run_name(o: RecoveryOptions, start: str, lr: float) -> str:
    """The name of one uptraining run's folder and cache entry: the start, and its rate where the start
    has several (a start with one rate keeps the name, and the cache, of a run without a sweep)."""
    return f"{start}-lr{lr:g}" if o.swept(start) else start


def uptrain_start(
    o: RecoveryOptions, store: ResultStore, inputs: Inputs, start: str, start_dir: Path, runs: Path,
    precision: str, lr: float,
) -> tuple[list[tuple[int, float]], float, bool]:  # fmt: skip
    """One uptraining run of ``start`` at peak rate ``lr``, evaluated on the held-out text at log-spaced
    steps; cached, and resumed from its last checkpoint when it was killed. Returns the curve, the run's
    wall time (the time it recorded in the store, which includes what an attempt killed before it
    spent), and whether that time is only the part after a resume (a run stored before results recorded
    their time, which was resumed)."""
    name = run_name(o, start, lr)
    out = runs / name
    recipe = recipe_from_dict(recipe_data(o, inputs, str(start_dir), out, lr, precision))
    key = {
        "start": fingerprint(start_dir),
        "recipe": weights_key(recipe.to_dict()),
        "texts": inputs.texts("train", "heldout"),
    }
    cached = store.get_output("run-" + name, key, out)
    if cached is None:
        # up to what changes how it goes, not what it trains (progress bars, speed levers and --device,
        # the checkpoint cadence): a run killed under another --device still resumes
        same = same_run(out, recipe)
        # the same recipe names the same paths, which a rebuilt split or conversion reuses: resume only a
        # run started after the start and the texts it reads were written
        same = same and _started_after(out / "recipe.yaml", [start_dir, inputs.train, inputs.heldout])
        resume = same and not (out / "gqakit.json").is_file() and not o.fresh
        res = uptrain(recipe, resume=resume, force=not resume)
        history = read_history(out)
        points = sorted({int(r["tokens"]): float(r["val_ppl"]) for r in history if "val_ppl" in r}.items())
        value = {"points": points, "elapsed_s": res.elapsed_s, "resumed": resume}
        cached = store.put_output("run-" + name, key, out, value)
    points = [(int(t), float(p)) for t, p in cached["points"]]
    recorded = store.time_of("run-" + name)
    if recorded is None:  # stored before results recorded their time: the run's own, after any resume
        return points, float(cached["elapsed_s"]), bool(cached.get("resumed", False))
    return points, recorded, False


def run_recovery(options: RecoveryOptions) -> RecoveryResult:
    """Convert SRC with each start, uptrain each on the same data and objective, and write the report.

    Args:
        options: the source, starts, data and run; every problem with them is reported before any
            conversion.

    Returns:
        A :class:`RecoveryResult`; the report is at ``result.report``.
    """
    o = options
    o.validate()
    writable_dir(o.out, "--out")
    writable_dir(o.work_dir, "--work-dir")
    with working_directory(o.work_dir) as work, ResultStore(work / "results", o.fresh) as store:
        return _recover(o, work, store)


def _recover(o: RecoveryOptions, work: Path, store: ResultStore) -> RecoveryResult:
    """:func:`run_recovery` once its options are valid and it holds the working directory ``work``."""
    quiet_transformers()
    t_start = time.perf_counter()
    steps = Steps(3 + len(o.starts), o.echo)
    precision = resolve_precision(o.precision, o.device)
    o.echo(
        f"gqakit recovery: {o.src} -> {o.groups} K/V heads from {', '.join(o.starts)}; {o.steps} steps x "
        f"{o.tokens_per_step:,} tokens = {o.steps * o.tokens_per_step:,} tokens per start, {o.objective}, "
        f"{precision}; working directory {work}"
    )
    with steps.step("Inputs: the original checkpoint, the groups, and the text split three ways"):
        src = resolve_source(o)
        inputs = Inputs(src, *split_data(o, store, work))
        check_source(o, src, inputs.calibration)
        steps.note(f"train {inputs.train}, calibration {inputs.calibration}, held out {inputs.heldout}")
    with steps.step("The original's held-out perplexity (the 1.0 line)"):
        original = original_ppl(o, store, inputs, precision)
        steps.note(f"original: {original:,.3f}")
    curves = []
    for start in o.starts:
        rates = o.rates_of(start)
        at = f"lr {rates[0]:g}" if len(rates) == 1 else f"each of lr {', '.join(f'{lr:g}' for lr in rates)}"
        with steps.step(f"Start {start!r}: convert, then uptrain {o.steps} steps at {at}"):
            start_dir, convert_s = convert_start(o, store, inputs, start, work / "models")
            for lr in rates:
                points, train_s, resumed = uptrain_start(
                    o, store, inputs, start, start_dir, work / "runs", precision, lr
                )
                curve = Curve(start, lr, points, convert_s, train_s, resumed, swept=len(rates) > 1)
                curve.reach = {t: tokens_to_reach(curve.ratios(original), t) for t in THRESHOLDS}
                steps.note(
                    f"{curve.label}: {points[0][1]:,.2f} -> {points[-1][1]:,.2f} at {points[-1][0]:,} tokens "
                    f"({points[-1][1] / original:.3f}x the original)"
                )
                curves.append(curve)
    with steps.step("Report: recovery.png, report.md, results.json"):
        elapsed = time.perf_counter() - t_start
        report, results_json, plot = write_report(o, inputs, precision, original, curves, elapsed, store)
    o.echo(f"Report: {report}")
    return RecoveryResult(original, curves, report, results_json, plot, elapsed)


__all__ = ["RecoveryResult", "run_recovery"]
