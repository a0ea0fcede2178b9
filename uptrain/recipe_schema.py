"""The recipe's typed sections, field by field (each field's help written once), and their rules.

:class:`Recipe` maps one-to-one onto a recipe YAML file; its :meth:`Recipe.problems` checks every rule
beyond the fields' types (the ranges in ``_RANGES`` and the cross-field rules). Loading, coercion and
overrides are :mod:`gqakit.uptrain.recipe`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from gqakit.cli_options import opt
from gqakit.convert import ConvertOptions
from gqakit.problems import Problems, device_problem, rate_problem

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
    precision: Literal["auto", "bf16", "fp32"] = opt(
        "fp32",
        "bf16 mixed precision (fp32 master weights), fp32, or auto: bf16 where the device has bf16 "
        "instructions, else fp32 (gqakit.json records what ran).",
    )
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    trainable: Literal["all", "attention"] = opt("all", "all (the paper), or the attention blocks only.")


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
    and read without pickled code."""

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
    """Metrics: OUTPUT_DIR/metrics.jsonl (one JSON record per line) and the log."""

    every: int = opt(1, "Steps between training-metric records.")
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
