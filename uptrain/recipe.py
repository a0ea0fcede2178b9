"""Uptraining recipes: typed dataclasses, YAML loading, ``key.sub=value`` overrides, validation.

A recipe is a commented YAML file (``recipes/*.yaml``) that maps one-to-one onto :class:`Recipe`.
Loading it checks every key and type and every cross-field rule, and reports *all* problems in one
:class:`RecipeError`, each naming the key, the bad value and what is allowed::

    recipe = load_recipe("recipes/smollm2-135m-mqa.yaml", ["train.lr=3e-4", "budget.steps=50"])

Strings may refer to environment variables as ``${VAR}`` or ``${VAR:-default}``, and ``~`` is the home
directory, so a shipped recipe can point into ``${GQAKIT_CACHE:-~/.cache/gqakit}``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from gqakit.convert.refine import REFINE_LR
from gqakit.errors import GqakitError, did_you_mean

Precision = Literal["bf16", "fp16", "fp32"]
Trainable = Literal["all", "attention", "kv"]
ObjectiveKind = Literal["lm", "distill", "mix"]
SaveDtype = Literal["auto", "float32", "bfloat16", "float16"]
TxtDocs = Literal["line", "paragraph", "file"]
CONVERT_METHODS = ("mean", "first", "random", "calibrated")  # gqakit.convert.api's, without importing torch
GROUPINGS = ("contiguous", "similarity")

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class RecipeError(GqakitError):
    """One or more problems with a recipe, all reported at once."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        head = f"Recipe {source} has {len(problems)} problem{'s' if len(problems) > 1 else ''}:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in problems)]))


# ---------------------------------------------------------------------------------------------------
# The recipe, section by section. Every field has a default unless the recipe must state it.
# ---------------------------------------------------------------------------------------------------


@dataclass
class ConvertConfig:
    """Convert the model before uptraining (``gqakit convert``), into ``OUTPUT_DIR/work/converted``.

    Attributes:
        groups: K/V heads after conversion (1 = MQA).
        method: ``mean`` (the paper's), ``first``, ``random`` or ``calibrated``.
        seed: seed for ``random``.
        calib_data: calibration text for ``calibrated`` and ``similarity`` (``gqakit convert --calib-data``).
        calib_tokens: calibration tokens.
        grouping: ``contiguous`` or ``similarity``.
        refine_steps: Adam steps per layer fitting each converted attention block to the original's
            output on ``calib_data`` (``gqakit convert --refine-steps``); 0: off.
        refine_lr: their learning rate.
    """

    groups: int
    method: str = "mean"
    seed: int = 0
    calib_data: str | None = None
    calib_tokens: int = 4096
    grouping: str = "contiguous"
    refine_steps: int = 0
    refine_lr: float = REFINE_LR


@dataclass
class ModelConfig:
    """The model to uptrain.

    Attributes:
        path: a converted checkpoint, or (with ``convert``) the source checkpoint: directory or hub id.
        convert: when set, ``path`` is converted first and the result is uptrained.
        save_dtype: dtype of the saved final model; ``auto`` = the dtype in the checkpoint's config.
    """

    path: str
    convert: ConvertConfig | None = None
    save_dtype: SaveDtype = "auto"


@dataclass
class DataConfig:
    """Training and validation text, tokenized with the model's tokenizer and packed into blocks.

    Attributes:
        files: local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` files or globs.
        val_files: validation files; without them ``val_split`` (hub) or ``val_fraction`` is used.
        hub: a hub dataset name instead of ``files`` (needs a network connection).
        hub_config: the hub dataset's configuration name.
        split: the hub split to train on.
        val_split: the hub split to validate on.
        text_field: the column holding the text (tables and hub datasets).
        txt_docs: what one document of a ``.txt`` file is: a ``line``, a blank-line separated
            ``paragraph``, or the whole ``file``.
        seq_len: tokens per packed block (the model sees ``seq_len`` tokens, predicts ``seq_len - 1``).
        add_eos: end every document with the tokenizer's EOS token before packing.
        val_fraction: fraction of packed blocks held out for validation when no validation data is given.
        max_val_blocks: cap on validation blocks (each eval costs one forward pass per block).
        num_proc: worker processes for tokenization (None: in-process).
    """

    files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    hub: str | None = None
    hub_config: str | None = None
    split: str = "train"
    val_split: str | None = None
    text_field: str = "text"
    txt_docs: TxtDocs = "line"
    seq_len: int = 512
    add_eos: bool = True
    val_fraction: float = 0.01
    max_val_blocks: int | None = 256
    num_proc: int | None = None


@dataclass
class BudgetConfig:
    """How much to train: exactly one of ``steps``, ``tokens`` or ``alpha``.

    One optimizer step consumes ``batch_size * grad_accum * processes * seq_len`` tokens; the log
    shows the budget in all three units.

    Attributes:
        steps: optimizer steps.
        tokens: training tokens (rounded up to whole steps).
        alpha: a fraction of ``pretraining_tokens`` (the paper uses 0.05).
        pretraining_tokens: tokens the model was originally pretrained on (Llama-2: 2e12).
    """

    steps: int | None = None
    tokens: int | None = None
    alpha: float | None = None
    pretraining_tokens: int | None = None


@dataclass
class TrainConfig:
    """Optimizer (AdamW), schedule (linear warmup, cosine decay) and batch.

    Attributes:
        lr: peak learning rate.
        betas: AdamW betas.
        weight_decay: AdamW weight decay, applied to matrices only (not norms or biases).
        eps: AdamW epsilon.
        warmup_fraction: fraction of the steps spent warming up linearly from ~0 to ``lr``.
        min_lr_ratio: the cosine decays to ``lr * min_lr_ratio``.
        batch_size: blocks per device per micro-step.
        grad_accum: micro-steps per optimizer step.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        precision: ``bf16`` / ``fp16`` mixed precision (fp32 master weights) or ``fp32``.
        gradient_checkpointing: recompute activations in backward to save memory.
        trainable: ``all`` (the paper), ``attention`` (attention blocks only) or ``kv`` (K/V only).
    """

    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    eps: float = 1e-8
    warmup_fraction: float = 0.02
    min_lr_ratio: float = 0.1
    batch_size: int = 8
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    precision: Precision = "fp32"
    gradient_checkpointing: bool = False
    trainable: Trainable = "all"


@dataclass
class ObjectiveConfig:
    """What the loss is.

    Attributes:
        kind: ``lm`` (next-token cross-entropy, the paper), ``distill`` (KL to the teacher) or ``mix``.
        temperature: softmax temperature of the KL (the KL is scaled by temperature squared).
        distill_weight: for ``mix``, loss = (1 - w) * lm + w * KL.
    """

    kind: ObjectiveKind = "lm"
    temperature: float = 1.0
    distill_weight: float = 0.5


@dataclass
class EvalConfig:
    """Validation perplexity.

    Attributes:
        every: steps between evaluations (0: only at the start and the end).
        at_start: evaluate before the first step (the converted model's perplexity).
        batch_size: blocks per device per forward pass (None: ``train.batch_size``).
    """

    every: int = 0
    at_start: bool = True
    batch_size: int | None = None


@dataclass
class CheckpointConfig:
    """Resumable checkpoints under ``OUTPUT_DIR/checkpoints`` (model, optimizer, scheduler, RNG, data).

    Attributes:
        every: steps between checkpoints (0: none, so no ``--resume`` and no rollback).
        keep: how many recent checkpoints to keep.
        keep_after_finish: keep them once the final model is saved (they hold optimizer state, 3x the
            model's size).
    """

    every: int = 0
    keep: int = 2
    keep_after_finish: bool = False


@dataclass
class GuardConfig:
    """What to do about a non-finite loss or gradient norm (the paper reports MQA instability).

    A bad step is skipped (no update). After ``max_bad_steps`` bad steps in a row the run rolls back
    to the last checkpoint and goes on with the learning rate times ``lr_factor``.

    Attributes:
        max_bad_steps: bad steps in a row before rolling back.
        lr_factor: learning rate multiplier applied at each rollback.
        max_rollbacks: give up (with an error) after this many rollbacks.
    """

    max_bad_steps: int = 3
    lr_factor: float = 0.5
    max_rollbacks: int = 3


@dataclass
class LogConfig:
    """Metrics: ``OUTPUT_DIR/metrics.jsonl`` always, TensorBoard under ``OUTPUT_DIR/tb`` when installed.

    Attributes:
        every: steps between training-metric records.
        tensorboard: also log to TensorBoard (if the package is installed).
        progress: show a progress bar.
    """

    every: int = 1
    tensorboard: bool = True
    progress: bool = True


@dataclass
class Recipe:
    """A complete uptraining run. ``model``, ``data``, ``budget`` and ``output_dir`` are required.

    Attributes:
        model: what to uptrain (and optionally convert first).
        data: training and validation text.
        budget: how long to train.
        output_dir: where the final model, metrics and checkpoints go.
        teacher: the original checkpoint, for ``distill`` / ``mix``; must share the model's vocabulary.
        train, objective, eval, checkpoint, guard, log: see each section.
        seed: seeds model-side randomness and the data order.
    """

    model: ModelConfig
    data: DataConfig
    budget: BudgetConfig
    output_dir: str
    teacher: str | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def problems(self) -> list[str]:
        """Every rule that involves more than one field's type; empty when the recipe is valid."""
        p: list[str] = []
        b, d, t, o = self.budget, self.data, self.train, self.objective
        given = [k for k in ("steps", "tokens", "alpha") if getattr(b, k) is not None]
        if len(given) != 1:
            p.append(
                "budget: give exactly one of steps, tokens or alpha"
                + (f" (got {', '.join(given)})." if given else ".")
            )
        for k in ("steps", "tokens", "alpha", "pretraining_tokens"):
            v = getattr(b, k)
            if v is not None and v <= 0:
                p.append(f"budget.{k} must be positive, got {v}.")
        if b.alpha is not None and b.pretraining_tokens is None:
            p.append(
                "budget.alpha needs budget.pretraining_tokens (the tokens the model was pretrained on, "
                "e.g. 2e12 for Llama-2)."
            )
        if not self.model.path:
            p.append("model.path is empty: give a checkpoint directory or hub id.")
        if self.model.convert is not None:
            c = self.model.convert
            if c.groups < 1:
                p.append(f"model.convert.groups must be a positive number of K/V heads, got {c.groups}.")
            if c.method not in CONVERT_METHODS:
                p.append(
                    f"model.convert.method {c.method!r} is unknown; "
                    f"choose one of {', '.join(CONVERT_METHODS)}."
                )
            if c.grouping not in GROUPINGS:
                p.append(
                    f"model.convert.grouping {c.grouping!r} is unknown; choose one of {', '.join(GROUPINGS)}."
                )
            if (
                c.method == "calibrated" or c.grouping == "similarity" or c.refine_steps
            ) and not c.calib_data:
                p.append(
                    "model.convert.calib_data is needed for method calibrated, grouping similarity or "
                    "refine_steps."
                )
            if c.refine_steps < 0:
                p.append(f"model.convert.refine_steps must be 0 (off) or positive, got {c.refine_steps}.")
            if not c.refine_lr > 0:
                p.append(f"model.convert.refine_lr must be a positive learning rate, got {c.refine_lr}.")
            if c.refine_steps > 0 and c.method == "random":
                p.append(
                    "model.convert.refine_steps cannot start from method random; use method calibrated "
                    "or mean."
                )
        if not self.output_dir:
            p.append("output_dir is empty.")
        if bool(d.files) == bool(d.hub):
            p.append("data: give either data.files (local files) or data.hub (a hub dataset), not both.")
        if d.val_files and d.hub:
            p.append("data.val_files goes with data.files; with data.hub use data.val_split.")
        if d.seq_len < 2:
            p.append(f"data.seq_len must be at least 2, got {d.seq_len}.")
        if not d.val_files and not d.val_split and not 0 < d.val_fraction < 1:
            p.append(f"data.val_fraction must be between 0 and 1 (exclusive), got {d.val_fraction}.")
        if d.max_val_blocks is not None and d.max_val_blocks < 1:
            p.append(f"data.max_val_blocks must be at least 1 (or null), got {d.max_val_blocks}.")
        if t.lr <= 0:
            p.append(f"train.lr must be positive, got {t.lr}.")
        if len(t.betas) != 2 or not all(0 <= x < 1 for x in t.betas):
            p.append(f"train.betas must be two numbers in [0, 1), got {t.betas}.")
        if t.weight_decay < 0:
            p.append(f"train.weight_decay must be >= 0, got {t.weight_decay}.")
        if not 0 <= t.warmup_fraction < 1:
            p.append(f"train.warmup_fraction must be in [0, 1), got {t.warmup_fraction}.")
        if not 0 <= t.min_lr_ratio <= 1:
            p.append(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}.")
        for k in ("batch_size", "grad_accum"):
            if getattr(t, k) < 1:
                p.append(f"train.{k} must be at least 1, got {getattr(t, k)}.")
        if t.max_grad_norm is not None and t.max_grad_norm <= 0:
            p.append(
                f"train.max_grad_norm must be positive (or null for no clipping), got {t.max_grad_norm}."
            )
        if o.kind in ("distill", "mix") and not self.teacher:
            p.append(f"objective.kind {o.kind!r} needs a teacher: set teacher to the original checkpoint.")
        if o.temperature <= 0:
            p.append(f"objective.temperature must be positive, got {o.temperature}.")
        if not 0 <= o.distill_weight <= 1:
            p.append(f"objective.distill_weight must be in [0, 1], got {o.distill_weight}.")
        for section, k in (("eval", "every"), ("checkpoint", "every"), ("checkpoint", "keep")):
            if getattr(getattr(self, section), k) < 0:
                p.append(f"{section}.{k} must be >= 0, got {getattr(getattr(self, section), k)}.")
        if self.eval.batch_size is not None and self.eval.batch_size < 1:
            p.append(f"eval.batch_size must be at least 1, got {self.eval.batch_size}.")
        if self.guard.max_bad_steps < 1:
            p.append(f"guard.max_bad_steps must be at least 1, got {self.guard.max_bad_steps}.")
        if not 0 < self.guard.lr_factor < 1:
            p.append(f"guard.lr_factor must be in (0, 1), got {self.guard.lr_factor}.")
        if self.guard.max_rollbacks < 0:
            p.append(f"guard.max_rollbacks must be >= 0, got {self.guard.max_rollbacks}.")
        if self.log.every < 1:
            p.append(f"log.every must be at least 1, got {self.log.every}.")
        return p


# ---------------------------------------------------------------------------------------------------
# Building dataclasses from plain data, collecting every problem.
# ---------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}s"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        type(None): "null",
    }.get(tp, str(tp))


def _coerce(tp: Any, value: Any, key: str, problems: list[str]) -> Any:
    """Check ``value`` against type ``tp``; return it (converted where harmless) or record a problem."""
    origin = typing.get_origin(tp)
    bad = f"{key}: expected {_describe(tp)}, got {value!r}"
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            trial: list[str] = []
            out = _coerce(arg, value, key, trial)
            if not trial:
                return out
        problems.append(bad + ".")
        return None
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = did_you_mean(str(value), [str(c) for c in choices])
            problems.append(
                f"{key}: {value!r} is not allowed.{hint} Choose one of {', '.join(map(str, choices))}."
            )
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            if item is str and isinstance(value, str):
                value = [value]  # a single path where a list of paths is expected
            else:
                problems.append(bad + ".")
                return None
        return [_coerce(item, v, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(bad + ".")
            return None
        return _build(tp, value, key + ".", problems)
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(bad + ".")
        return value
    if tp in (int, float):
        # YAML reads 2e12 (no dot) as a string; accept numbers written that way.
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(bad + ".")
            return None
        if tp is int:
            if float(value).is_integer():
                return int(value)
            problems.append(bad + " (not a whole number).")
            return None
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(bad + ".")
            return None
        return value
    return value


def _build(cls: type, data: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    section = prefix.rstrip(".") or "the recipe"
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            hint = did_you_mean(str(key), names)
            problems.append(f"{prefix}{key}: unknown key.{hint} Known keys in {section}: {', '.join(names)}.")
            continue
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", problems)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    for name in missing:
        problems.append(f"{prefix}{name} is required ({_describe(hints[name])}).")
    if missing or any(v is None and not _optional(hints[k]) for k, v in kwargs.items()):
        return None
    return cls(**kwargs)


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand(text: str) -> str:
    """``${VAR}`` and ``${VAR:-default}`` from the environment, then a leading ``~``."""
    out = _ENV.sub(lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), text)
    return os.path.expanduser(out)


def _expand_all(value: Any) -> Any:
    if isinstance(value, str):
        return expand(value)
    if isinstance(value, list):
        return [_expand_all(v) for v in value]
    if isinstance(value, dict):
        return {k: _expand_all(v) for k, v in value.items()}
    return value


def apply_overrides(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...], problems: list[str]
) -> None:
    """Apply ``key.sub=value`` overrides in place; values are YAML (``[a, b]``, ``null``, ``3e-4``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} is not key=value (e.g. train.lr=3e-4).")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section.")
                break
            node = child
        else:
            node[parts[-1]] = value


def shipped_recipes() -> list[str]:
    return sorted(p.name for p in RECIPES_DIR.glob("*.yaml"))


def _find(path: str | Path) -> Path:
    p = Path(expand(str(path)))
    if p.is_file():
        return p
    for candidate in (RECIPES_DIR / p.name, RECIPES_DIR / f"{p.name}.yaml"):
        if p.parent == Path(".") and candidate.is_file():  # a bare shipped name: `smollm2-135m-mqa`
            return candidate
    known = ", ".join(shipped_recipes())
    what = "is a directory" if p.is_dir() else "does not exist"
    raise GqakitError(f"Recipe {path} {what}. Give a YAML file; shipped recipes ({RECIPES_DIR}): {known}.")


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe, apply overrides, and validate everything at once.

    Args:
        path: a YAML file, or the name of a shipped recipe (``smollm2-135m-mqa``).
        overrides: ``key.sub=value`` strings, applied in order after the file.

    Raises:
        GqakitError: the file is missing or not YAML.
        RecipeError: any unknown key, wrong type or invalid value, all listed.
    """
    file = _find(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise GqakitError(f"Recipe {file} is not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise GqakitError(f"Recipe {file} is not a UTF-8 text file.") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise GqakitError(
            f"Recipe {file} must be a YAML mapping of sections (model:, data:, ...), not a list or value."
        )
    return recipe_from_dict(data, overrides, source=str(file))


def recipe_from_dict(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str = "<dict>"
) -> Recipe:
    """Build and validate a :class:`Recipe` from plain data (what the YAML file holds)."""
    problems: list[str] = []
    data = dict(data)
    apply_overrides(data, overrides, problems)
    data = _expand_all(data)
    recipe = _build(Recipe, data, "", problems)
    if recipe is not None and not problems:
        problems.extend(recipe.problems())
    if problems:
        raise RecipeError(source, problems)
    return recipe


__all__ = [
    "BudgetConfig",
    "CheckpointConfig",
    "ConvertConfig",
    "DataConfig",
    "EvalConfig",
    "GuardConfig",
    "LogConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "Recipe",
    "RecipeError",
    "TrainConfig",
    "apply_overrides",
    "expand",
    "load_recipe",
    "recipe_from_dict",
    "shipped_recipes",
]
