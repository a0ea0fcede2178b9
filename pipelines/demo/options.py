"""What ``gqakit demo`` runs on and with: its assets, the conversions it shows, and its options."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gqakit.cli_options import opt
from gqakit.dtypes import LOAD_DTYPES
from gqakit.errors import GqakitError
from gqakit.pipelines.steps import PipelineOptions, at_least, out_field, work_dir_field
from gqakit.problems import Problems
from gqakit.uptrain.recipe import load_recipe

SMOLLM2 = "smollm2-135m"
RECIPE = "smollm2-135m-mqa"  # shipped in recipes/, found by name; the variants' default
KV_TOKENS = 2048  # the table's KV-cache column: one sequence of this many tokens
DECODE_BATCH, NEW_TOKENS = 8, 16  # the decode point: sequences decoded together, greedy steps timed


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
        start: the conversion, by preset or method (:data:`~gqakit.pipelines.starts.STARTS`); a start that
            reads text calibrates on the training split.
        uptrain: uptrain this model with ``recipe`` and add an "after uptraining" row.
        recipe: its uptraining recipe (a shipped name or a path).
    """

    slug: str
    groups: int
    start: str = "mean"
    uptrain: bool = False
    recipe: str = RECIPE


VARIANTS: tuple[Variant, ...] = (
    Variant("gqa-mean", groups=0),  # back to the original's G: must reproduce it exactly
    Variant("mqa-mean", groups=1, uptrain=True),  # the paper's method, uptrained with the demo's recipe
    # the fast preset (calibrated merge + 200 refinement steps per layer), and its own recipe
    Variant("mqa-fast", groups=1, start="fast", uptrain=True, recipe="smollm2-135m-mqa-refined"),
)


@dataclass(kw_only=True)
class DemoOptions(PipelineOptions):
    """Options of ``gqakit demo`` (and the common ones of :class:`~gqakit.pipelines.steps.PipelineOptions`).

    The fields without a flag are for Python callers and tests: the perplexity window, the decode context
    and the asset step (None fetches SmolLM2 and wiki-en).
    """

    out: Path = out_field("demo-report")
    work_dir: Path = work_dir_field("demo-work")
    dtype: str = opt("auto", "Evaluation dtype; auto: float32 on CPU, bfloat16 on CUDA.", choices=LOAD_DTYPES)
    budget_scale: float = opt(
        1.0, "Multiply the recipe's uptraining budget (e.g. 6 for about an hour on 2 CPU cores)."
    )
    eval_tokens: int | None = opt(None, "Test tokens scored per model [default: 8192 on CPU, all on GPU].")
    decode_rounds: int = opt(
        5,
        "Short interleaved rounds of the side-by-side decode measurement (the table shows each model's "
        "median and spread; no speedup when the rounds disagree).",
    )
    seq_len: int = opt(512, cli=False)
    decode_context: int | None = opt(None, cli=False)  # None: 512 on CPU, 2048 on a GPU
    assets: Callable[[DemoOptions], DemoAssets] | None = opt(None, cli=False)

    def check(self, p: Problems) -> None:
        """Every problem with the options, and with the uptraining recipes and their overrides, at once:
        a misspelled ``--recipe`` or a malformed ``--set`` is reported at once, not after the first
        steps' minutes."""
        super().check(p)
        f = p.flag
        at_least(p, self, 1, "seq_len", "decode_rounds", "eval_tokens", "decode_context")  # None: the default
        if not self.budget_scale > 0:
            p.add(f"{f('budget_scale')} must be positive, got {self.budget_scale}.")
        if self.dtype not in LOAD_DTYPES:
            p.add(f"{f('dtype')} {self.dtype!r} is unknown; choose one of {', '.join(LOAD_DTYPES)}.")
        if p:
            return
        placeholder = DemoAssets(Path("model"), Path("train.txt"), Path("validation.txt"), Path("test.txt"))
        for name in dict.fromkeys(v.recipe for v in VARIANTS if v.uptrain):
            try:
                load_demo_recipe(self, placeholder, Path("student"), Path("teacher"), Path("out"), name)
            except GqakitError as e:
                p.add(e.message)


def load_demo_recipe(
    options: DemoOptions, assets: DemoAssets, student: Path, teacher: Path, out: Path, recipe_name: str
):
    """The shipped recipe pointed at this run's checkpoints and data, with the user's overrides."""
    paths = [
        f"model.path={json.dumps(str(student))}",
        "model.convert=null",
        f"teacher={json.dumps(str(teacher))}",
        f"data.files={json.dumps([str(assets.train)])}",
        f"data.val_files={json.dumps([str(assets.validation)])}",
        f"output_dir={json.dumps(str(out))}",
        # where every other step runs (auto: where accelerate puts it); not in the cache key (speed.*)
        f"speed.device={json.dumps(options.device)}",
    ]
    if not options.progress:
        paths.append("log.progress=false")
    recipe = load_recipe(recipe_name, [*paths, *options.recipe_sets])
    b = recipe.budget  # scaled by --budget-scale (1: as the recipe gives it)
    if b.steps is not None:
        b.steps = max(1, round(b.steps * options.budget_scale))
    elif b.tokens is not None:
        b.tokens = max(1, round(b.tokens * options.budget_scale))
    else:
        b.alpha = b.alpha * options.budget_scale
    return recipe
