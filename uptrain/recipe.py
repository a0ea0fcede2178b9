"""Uptraining recipes: the typed sections, YAML loading, ``key.sub=value`` overrides and validation.

A recipe is a commented YAML file (``recipes/*.yaml``) that maps one-to-one onto :class:`Recipe`. Each
field says what it means once, in its ``help`` metadata. Loading checks every key, type and cross-field
rule and reports *all* problems in one :class:`RecipeError`, each naming the key, the bad value and what
is allowed::

    recipe = load_recipe("recipes/smollm2-135m-mqa.yaml", ["train.lr=3e-4", "budget.steps=50"])

The ``model.convert`` section is :class:`gqakit.convert.ConvertOptions` itself (the options of
``gqakit convert``, checked by its own rules). Strings may refer to environment variables as ``${VAR}``
or ``${VAR:-default}``, and ``~`` is the home directory, so a shipped recipe can point into
``${GQAKIT_CACHE:-~/.cache/gqakit}``. What a recipe points at (files, the machine, the run directory) is
checked when a run starts (:mod:`gqakit.uptrain.preflight`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from gqakit.cli_options import Problems, device_problem, opt, rate_problem
from gqakit.convert import ConvertOptions
from gqakit.errors import GqakitError, did_you_mean

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class RecipeError(GqakitError):
    """One or more problems with a recipe, all reported at once."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        head = f"Recipe {source} has {len(problems)} problem{'s' if len(problems) > 1 else ''}:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in problems)]))


# --------------- The recipe, section by section. Every field has a default unless the recipe must state it.


@dataclass
class ModelConfig:
    """The model to uptrain."""

    path: str = opt(help="A converted checkpoint, or (with convert) its source: a model, as every SRC.")
    convert: ConvertOptions | None = opt(
        None,
        "Convert path first (the options of `gqakit convert`: groups, preset, method, calib_data...), into "
        "OUTPUT_DIR/work/converted, and uptrain the result.",
    )
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "Dtype of the saved final model; auto: the dtype the checkpoint's config states."
    )


@dataclass
class DataConfig:
    """Training and validation text, tokenized with the model's tokenizer and packed into blocks."""

    files: list[str] = opt(help="Local .txt / .jsonl / .json / .parquet files or globs.", factory=list)
    val_files: list[str] = opt(
        help="Validation files (else val_split with hub, or val_fraction).", factory=list
    )
    hub: str | None = opt(None, "A hub dataset name instead of files (needs a network connection).")
    hub_config: str | None = opt(None, "The hub dataset's configuration name.")
    split: str = opt("train", "The hub split to train on.")
    val_split: str | None = opt(None, "The hub split to validate on (with files: val_files).")
    text_field: str = opt("text", "The column holding the text (tables and hub datasets).")
    txt_docs: Literal["line", "paragraph", "file"] = opt(
        "line", "What one document of a .txt file is: a line, a blank-line separated paragraph, or the file."
    )
    seq_len: int = opt(512, "Tokens per packed block (the model sees seq_len tokens, predicts seq_len - 1).")
    add_eos: bool = opt(True, "End every document with the tokenizer's EOS token before packing.")
    val_fraction: float = opt(0.01, "Fraction of the blocks held out for validation, without val data.")
    max_val_blocks: int | None = opt(256, "Cap on validation blocks (each eval costs one forward per block).")
    num_proc: int | None = opt(None, "Worker processes for tokenization (null: in-process).")


@dataclass
class BudgetConfig:
    """How much to train: exactly one of steps, tokens or alpha. One optimizer step consumes
    ``batch_size * grad_accum * processes * seq_len`` tokens; the log shows the budget in all three."""

    steps: int | None = opt(None, "Optimizer steps.")
    tokens: int | None = opt(None, "Training tokens (rounded up to whole steps).")
    alpha: float | None = opt(None, "A fraction of pretraining_tokens (the paper uses 0.05).")
    pretraining_tokens: int | None = opt(None, "Tokens the model was pretrained on (Llama-2: 2e12).")


@dataclass
class TrainConfig:
    """Optimizer (AdamW), schedule (linear warmup, cosine decay) and batch."""

    lr: float = opt(1e-4, "Peak learning rate.")
    betas: list[float] = opt(help="AdamW betas.", factory=lambda: [0.9, 0.95])
    weight_decay: float = opt(0.1, "AdamW weight decay, applied to matrices only (not norms or biases).")
    eps: float = opt(1e-8, "AdamW epsilon.")
    warmup_fraction: float = opt(0.02, "Fraction of the steps spent warming up linearly from ~0 to lr.")
    min_lr_ratio: float = opt(0.1, "The cosine decays to lr * min_lr_ratio.")
    batch_size: int = opt(8, "Blocks per process per micro-step.")
    grad_accum: int = opt(1, "Micro-steps per optimizer step.")
    max_grad_norm: float | None = opt(1.0, "Clip the global gradient norm to this (null: no clipping).")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = opt(
        "fp32",
        "bf16 / fp16 mixed precision (fp32 master weights), fp32, or auto: bf16 where the device has bf16 "
        "instructions, else fp32 (gqakit.json records what ran).",
    )
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    trainable: Literal["all", "attention", "kv"] = opt(
        "all", "all (the paper), attention (attention blocks only) or kv (the K/V projections only)."
    )


@dataclass
class ObjectiveConfig:
    """What the loss is."""

    kind: Literal["lm", "distill", "mix"] = opt(
        "lm", "lm (next-token cross-entropy, the paper), distill (KL to the teacher) or mix."
    )
    temperature: float = opt(1.0, "Softmax temperature of the KL (the KL is scaled by temperature squared).")
    distill_weight: float = opt(0.5, "For mix: loss = (1 - w) * lm + w * KL.")


@dataclass
class SpeedConfig:
    """How fast the loop runs; none of it changes what is trained beyond floating-point rounding. ``auto``
    picks, per device, what was measured fastest (docs/uptrain.md#speed); a lever the device cannot run
    is turned off with one log line saying so."""

    fused_loss: bool | Literal["auto"] = opt(
        "auto",
        "The output projection and the loss in one chunked pass that never holds the [tokens, vocab] "
        "logits (student and teacher). auto: on a CPU, and on a GPU with compile, in one process or DDP.",
    )
    compile: bool | Literal["auto"] = opt(
        "auto", "torch.compile each decoder layer (student and teacher). auto: CUDA in one process or DDP."
    )
    kernels: Literal["auto", "liger", "none"] = opt(
        "auto", "liger (liger-kernel's fused RMSNorm, RoPE, SwiGLU; CUDA) or none. auto: none."
    )
    device: str = opt(
        "auto",
        "Where a single-process run trains: cpu, cuda, cuda:N, or auto (accelerate's choice: CUDA when "
        "present). A distributed launch places its processes itself: auto only there.",
    )


@dataclass
class EvalConfig:
    """Validation perplexity."""

    every: int = opt(0, "Steps between evaluations (0: only at the start and the end).")
    at_steps: list[int] = opt(help="Further steps to evaluate after (a recovery curve's).", factory=list)
    at_start: bool = opt(True, "Evaluate before the first step (the converted model's perplexity).")
    batch_size: int | None = opt(None, "Blocks per process per forward pass (null: train.batch_size).")


@dataclass
class CheckpointConfig:
    """Resumable checkpoints under OUTPUT_DIR/checkpoints (model, optimizer, RNG, data position), written
    and read without pickled code; none under DeepSpeed (every must be 0 there)."""

    every: int = opt(0, "Steps between checkpoints (0: none, so no --resume and no rollback).")
    keep: int = opt(2, "How many recent checkpoints to keep (at least 1).")
    keep_after_finish: bool = opt(False, "Keep them once the final model is saved (3x its size).")


@dataclass
class GuardConfig:
    """A non-finite loss or gradient norm skips the step (no update); max_bad_steps in a row roll the run
    back to the last checkpoint with the learning rate times lr_factor (the paper reports MQA
    instability)."""

    max_bad_steps: int = opt(3, "Bad steps in a row before rolling back.")
    lr_factor: float = opt(0.5, "Learning-rate multiplier applied at each rollback.")
    max_rollbacks: int = opt(3, "Give up (with an error) after this many rollbacks.")


@dataclass
class LogConfig:
    """Metrics: OUTPUT_DIR/metrics.jsonl always, TensorBoard under OUTPUT_DIR/tb when installed."""

    every: int = opt(1, "Steps between training-metric records.")
    tensorboard: bool = opt(True, "Also log to TensorBoard (if the package is installed).")
    progress: bool = opt(True, "Show a progress bar.")
    all_ranks: bool = opt(False, "Log from every process of a launch (else: errors only, but the main's).")


@dataclass
class Recipe:
    """A complete uptraining run. ``model``, ``data``, ``budget`` and ``output_dir`` are required."""

    model: ModelConfig = opt(help="What to uptrain (and optionally convert first).")
    data: DataConfig = opt(help="Training and validation text.")
    budget: BudgetConfig = opt(help="How long to train.")
    output_dir: str = opt(help="Where the final model, metrics and checkpoints go.")
    teacher: str | None = opt(None, "The original model, for objective.kind distill / mix (same vocabulary).")
    train: TrainConfig = opt(help="Optimizer, schedule and batch.", factory=TrainConfig)
    speed: SpeedConfig = opt(help="Speed levers and the device.", factory=SpeedConfig)
    objective: ObjectiveConfig = opt(help="The loss.", factory=ObjectiveConfig)
    eval: EvalConfig = opt(help="Validation perplexity.", factory=EvalConfig)
    checkpoint: CheckpointConfig = opt(help="Resumable checkpoints.", factory=CheckpointConfig)
    guard: GuardConfig = opt(help="Non-finite steps.", factory=GuardConfig)
    log: LogConfig = opt(help="Metrics and progress.", factory=LogConfig)
    seed: int = opt(0, "Seeds model-side randomness and the data order.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def problems(self) -> list[str]:
        """Every rule beyond the fields' types; empty when the recipe is valid."""
        p: list[str] = []
        b, d = self.budget, self.data
        given = [k for k in ("steps", "tokens", "alpha") if getattr(b, k) is not None]
        if len(given) != 1:
            got = f" (got {', '.join(given)})." if given else "."
            p.append(f"budget: give exactly one of steps, tokens or alpha{got}")
        if b.alpha is not None and b.pretraining_tokens is None:
            p.append(
                "budget.alpha needs budget.pretraining_tokens (the tokens the model was pretrained on, "
                "e.g. 2e12 for Llama-2)."
            )
        for key, ok, allowed in _RANGES:
            section, _, name = key.partition(".")
            value = getattr(getattr(self, section), name)
            if value is not None and not ok(value):
                p.append(f"{key} must be {allowed}, got {value}.")
        if not self.model.path:
            p.append("model.path is empty: give a checkpoint directory or hub id.")
        if self.model.convert is not None:  # convert's own rules, its fields named as the recipe names them
            convert = Problems("convert", names=lambda f: f"model.convert.{f}")
            self.model.convert.check(convert, paths=False)
            p += convert.messages
        if not self.output_dir:
            p.append("output_dir is empty.")
        if bool(d.files) == bool(d.hub):
            p.append("data: give either data.files (local files) or data.hub (a hub dataset), not both.")
        if d.val_files and d.hub:
            p.append("data.val_files goes with data.files; with data.hub use data.val_split.")
        if d.val_split and d.files and not d.hub:  # the data would ignore it, holding out val_fraction
            p.append(
                f"data.val_split={d.val_split!r} only applies to data.hub; with data.files set "
                "data.val_split=null and give data.val_files (or hold out data.val_fraction)."
            )
        if not d.val_files and not (d.hub and d.val_split) and not 0 < d.val_fraction < 1:
            p.append(f"data.val_fraction must be between 0 and 1 (exclusive), got {d.val_fraction}.")
        # YAML reads .inf and .nan: such a run fails steps into it (the field's default in the message)
        p.append(rate_problem("train.lr", self.train.lr, TrainConfig.lr))
        kind = self.objective.kind
        if kind in ("distill", "mix") and not self.teacher:
            p.append(f"objective.kind {kind!r} needs a teacher: set teacher to the original checkpoint.")
        p.append(device_problem(self.speed.device, "speed.device"))
        return [m for m in p if m]


def _at_least(n: float):
    return lambda v: v >= n


def _positive(v: float) -> bool:
    return v > 0


# The rules of single numbers beyond their type: (key, test, what is allowed); null passes.
_RANGES = [
    *((f"budget.{k}", _positive, "positive") for k in ("steps", "tokens", "alpha", "pretraining_tokens")),
    ("data.seq_len", _at_least(2), "at least 2"),
    ("data.max_val_blocks", _at_least(1), "at least 1 (or null)"),
    ("train.weight_decay", _at_least(0), ">= 0"),
    ("train.warmup_fraction", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("train.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("train.batch_size", _at_least(1), "at least 1"),
    ("train.grad_accum", _at_least(1), "at least 1"),
    ("train.max_grad_norm", _positive, "positive (or null for no clipping)"),
    ("train.betas", lambda v: len(v) == 2 and all(0 <= x < 1 for x in v), "two numbers in [0, 1)"),
    ("objective.temperature", _positive, "positive"),
    ("objective.distill_weight", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("eval.every", _at_least(0), ">= 0"),
    ("eval.batch_size", _at_least(1), "at least 1"),
    ("eval.at_steps", lambda v: all(n >= 1 for n in v), "steps of at least 1"),
    ("checkpoint.every", _at_least(0), ">= 0"),
    # 0 would delete each checkpoint as it is written
    (
        "checkpoint.keep",
        _at_least(1),
        "at least 1 (--resume and the non-finite guard's rollback need the newest checkpoint; to write "
        "none, set checkpoint.every=0)",
    ),
    ("guard.max_bad_steps", _at_least(1), "at least 1"),
    ("guard.lr_factor", lambda v: 0 < v < 1, "in (0, 1)"),
    ("guard.max_rollbacks", _at_least(0), ">= 0"),
    ("log.every", _at_least(1), "at least 1"),
]


# -------------------------------- Plain data (what YAML holds) -> the dataclasses, collecting every problem

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
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(tp, str(tp))


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _coerce(tp: Any, value: Any, key: str, problems: list[str]) -> Any:
    """Check ``value`` against type ``tp``; return it (converted where harmless) or record a problem."""
    if isinstance(value, str):
        value = expand(value)
    origin = typing.get_origin(tp)
    bad = f"{key}: expected {_describe(tp)}, got {value!r}"
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):  # a section: its own problems
                return _coerce(arg, value, key, problems)
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
    if tp is str and not isinstance(value, str):
        problems.append(bad + ".")
        return None
    return value


def _build(cls: type, data: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    """``cls(**data)``, each value checked against its field's type; None when anything is missing."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    section = prefix.rstrip(".") or "the recipe"
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            hint = did_you_mean(str(key), names)
            problems.append(f"{prefix}{key}: unknown key.{hint} Known keys in {section}: {', '.join(names)}.")
            continue
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", problems)
    missing = [
        f
        for f in fields
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    for f in missing:
        what = f.metadata.get("gqakit", {}).get("help", "")
        problems.append(f"{prefix}{f.name} is required ({_describe(hints[f.name])}). {what}".rstrip())
    if missing or any(v is None and not _optional(hints[k]) for k, v in kwargs.items()):
        return None
    return cls(**kwargs)


# ------------------------------------------------------------------------------------ Loading and overrides

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand(text: str) -> str:
    """``${VAR}`` and ``${VAR:-default}`` from the environment, then a leading ``~``."""
    out = _ENV.sub(lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), text)
    return os.path.expanduser(out)


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
    data = copy.deepcopy(data)  # overrides write into nested sections: never into the caller's dicts
    apply_overrides(data, overrides, problems)
    recipe = _build(Recipe, data, "", problems)
    if recipe is not None and not problems:
        problems.extend(recipe.problems())
    if problems:
        raise RecipeError(source, problems)
    return recipe
