"""The replicate pipeline: :func:`run_replicate` (see :mod:`gqakit.pipelines.replicate`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from gqakit.assets import publish, read_manifest
from gqakit.cli_options import click_options, options_from
from gqakit.convert.methods import PAPER_METHODS
from gqakit.pipelines.replicate.options import ReplicateOptions
from gqakit.pipelines.replicate.report import write_replicate_report
from gqakit.pipelines.replicate.train import (
    Context,
    convert_arm,
    decode_times,
    init_model,
    perplexity_of,
    train_run,
    train_tokenizer,
)
from gqakit.pipelines.steps import Steps, pipeline_run, set_option, wiki_splits
from gqakit.pipelines.store import ResultStore
from gqakit.problems import check_options
from gqakit.storage import cache_root

STEPS = 7
MHA = "mha"


@dataclass
class Arm:
    """One model of the report: how it was made and what it measured."""

    name: str
    kind: str  # "mha", "converted", "scratch"
    groups: int
    method: str | None = None
    alpha: float = 0.0
    seed: int = 0
    path: str = ""
    ppl: float | None = None
    uptrain: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReplicateResult:
    """What :func:`run_replicate` measured and wrote."""

    arms: list[Arm]
    decode: dict[int, dict[str, Any]]
    pretrain_tokens: int
    report: Path
    results_json: Path
    figures: list[Path]
    elapsed_s: float


def _setup(
    o: ReplicateOptions, total_steps: int, work: Path, store: ResultStore
) -> tuple[Context, Path, Arm]:
    """Steps 1-3: the corpus, the tokenizer and the pretrained MHA model (published as an asset), in the
    working directory ``work`` (held: :func:`~gqakit.pipelines.steps.pipeline_run`) and its ``store``."""
    steps = Steps(total_steps, o.echo)
    m = o.model
    o.echo(
        f"gqakit replicate: {m.layers} layers, hidden {m.hidden}, {m.heads} heads, "
        f"vocab {m.vocab}; "
        f"pretraining {o.steps} steps x {o.tokens_per_step:,} tokens = {o.pretrain_tokens:,} tokens; "
        f"alphas {', '.join(map(str, o.alphas))}; working directory {work}"
    )
    with steps.step("Corpus: training, validation and test text"):
        corpus = tuple(map(Path, o.corpus)) if o.corpus is not None else wiki_splits(o)
        steps.note(f"{corpus[0].parent}")
    ctx = Context(o, store, steps, work / "models", *corpus)
    with steps.step(f"Tokenizer: byte-level BPE, {m.vocab:,} tokens, trained on the train split"):
        tok = train_tokenizer(ctx)
    with steps.step(f"Pretrain the MHA model ({m.heads} query and {m.heads} K/V heads) from scratch"):
        init = init_model(ctx, tok, m.heads, seed=0)
        mha = ctx.models / MHA
        summary = train_run(ctx, init, mha, o.steps, seed=0)
        _publish(ctx, mha, summary)
    return ctx, tok, Arm(MHA, "mha", m.heads, path=str(mha), uptrain=summary)


def pretrain_mha(options: ReplicateOptions | None = None) -> Path:
    """Only steps 1-3: train the tokenizer and the MHA model (``recipes/replicate-mha.yaml``) and make it
    the asset ``replicate-mha``; return the model's directory. ``gqakit replicate --pretrain-only``."""
    o = check_options(options or ReplicateOptions(), "replicate")
    with pipeline_run(o) as (work, store):
        _, _, mha = _setup(o, 3, work, store)
    return Path(mha.path)


def run_replicate(options: ReplicateOptions | None = None) -> ReplicateResult:
    """Run the experiments (see the module docstring) and write the report.

    Args:
        options: sizes, grids, seeds and places; the defaults run in under an hour on 2 CPU cores.

    Returns:
        A :class:`ReplicateResult`; the report is at ``result.report``.
    """
    o = check_options(options or ReplicateOptions(), "replicate")
    with pipeline_run(o) as (work, store):
        return _replicate(o, work, store)


def _replicate(o: ReplicateOptions, work: Path, store: ResultStore) -> ReplicateResult:
    """:func:`run_replicate` once its options are valid and it holds the working directory ``work``."""
    ctx, tok, mha_arm = _setup(o, STEPS, work, store)
    steps, m = ctx.steps, o.model
    mha = Path(mha_arm.path)
    arms: list[Arm] = [mha_arm]

    jobs = _arm_plan(o)
    with steps.step(f"Convert MHA -> {len({(j.method, j.groups) for j in jobs})} starts"):
        starts = {(j.method, j.groups): convert_arm(ctx, mha, j.method, j.groups) for j in jobs}  # type: ignore[arg-type]
    with steps.step("Uptrain every arm; pretrain MQA, GQA and MHA from scratch on the same total budget"):
        for j in jobs:
            start_dir = starts[(j.method, j.groups)]
            if j.alpha == 0:
                j.path = str(start_dir)
            else:
                dst = ctx.models / j.name
                j.uptrain = train_run(ctx, start_dir, dst, o.uptrain_steps(j.alpha), j.seed, uptraining=True)
                j.path = str(dst)
            arms.append(j)
        top = max(o.alphas)
        if top > 0:  # MHA trained on as many more tokens: the fair reference for the uptrained arms
            dst = ctx.models / f"mha-continued-a{top:g}"
            summary = train_run(ctx, mha, dst, o.uptrain_steps(top), o.seeds[0], uptraining=True)
            arms.append(Arm(dst.name, "mha-continued", m.heads, alpha=top, path=str(dst), uptrain=summary))
        total = o.steps + o.uptrain_steps(top)
        # MQA and the largest GQA from scratch, and MHA too: what the same total tokens in one schedule
        # buy by themselves, apart from the number of K/V heads
        for g in dict.fromkeys((1, max(o.groups), m.heads)):
            init_g = init_model(ctx, tok, g, seed=0)
            dst = ctx.models / f"scratch-g{g}"
            summary = train_run(ctx, init_g, dst, total, seed=0)
            arms.append(Arm(f"scratch-g{g}", "scratch", g, path=str(dst), uptrain=summary))
    with steps.step(f"Measure: test perplexity of {len(arms)} models, decode time per token at each G"):
        for a in arms:
            a.ppl = perplexity_of(ctx, Path(a.path))
            steps.note(f"{a.name}: perplexity {a.ppl:,.2f}")
        by_g = {m.heads: mha, **{g: starts[("mean", g)] for g in o.groups}}
        decode = decode_times(ctx, by_g)
    with steps.step("Report"):
        report, results_json, figures = write_replicate_report(o, arms, decode, steps.elapsed, store)
    o.echo(f"Report: {report}")
    return ReplicateResult(arms, decode, o.pretrain_tokens, report, results_json, figures, steps.elapsed)


def _publish(ctx: Context, mha: Path, summary: dict) -> None:
    """Make the pretrained MHA model an asset (``gqakit assets list`` shows it), once per build."""
    info = {"model": asdict(ctx.o.model), "pretrain_tokens": ctx.o.pretrain_tokens, "files": summary["files"]}
    manifest = read_manifest(cache_root(ctx.o.cache_dir) / "replicate-mha")
    if manifest is None or manifest.get("info", {}).get("files") != info["files"]:
        root = publish("replicate-mha", mha, info, ctx.o.cache_dir).root
        ctx.steps.note(f"published as the asset replicate-mha: {root / 'model'}")


def _arm_plan(o: ReplicateOptions) -> list[Arm]:
    """Every converted arm: MQA by each method at each alpha (the paper's methods at the middle alpha
    over every seed), and mean-pooled GQA at each G at the largest alpha."""
    jobs: dict[str, Arm] = {}

    def add(method: str, g: int, alpha: float, seed: int) -> None:
        name = f"g{g}-{method}-a{alpha:g}" + (f"-s{seed}" if alpha > 0 else "")
        jobs.setdefault(name, Arm(name, "converted", g, method, alpha, seed if alpha > 0 else 0))

    for method in o.starts:
        for alpha in o.alphas:
            add(method, 1, alpha, o.seeds[0])
    for method in (m for m in PAPER_METHODS if m in o.starts):
        for seed in o.seeds[1:]:
            add(method, 1, o.middle_alpha, seed)
    for g in o.groups:
        for alpha in (0.0, max(o.alphas)):
            add("mean", g, alpha, o.seeds[0])
    return list(jobs.values())


@click.command("replicate")
@click_options(ReplicateOptions)
@set_option(
    "Override the uptraining runs' recipe (repeatable), e.g. --set train.lr=1e-3; model.convert.* "
    "changes the conversions that use it."
)
@click.option(
    "--pretrain-only",
    is_flag=True,
    help="Only train the tokenizer and the MHA model (recipes/replicate-mha.yaml) and make it the asset "
    "replicate-mha.",
)
def replicate_cmd(pretrain_only: bool, **kwargs: Any) -> None:
    """Re-run the GQA paper's experiments (Ainslie et al. 2023) on an MHA model pretrained here: which
    start (Fig. 4), how much uptraining (Fig. 5), how many groups (Fig. 6, Table 1), uptrained against
    trained from scratch; with gqakit's calibrated merge and its fast preset beside the paper's methods."""
    options = options_from(ReplicateOptions, kwargs)
    if pretrain_only:
        click.echo(f"MHA model: {pretrain_mha(options)}")
        return
    run_replicate(options)
