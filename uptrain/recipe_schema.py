"""The uptraining recipe's schema: typed dataclasses, one per section of the YAML file.

A recipe is a commented YAML file (``recipes/*.yaml``) that maps one-to-one onto :class:`Recipe`; loading
and overrides are in :mod:`gqakit.uptrain.recipe`, the rules that involve several fields in
:mod:`gqakit.uptrain.recipe_checks`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from gqakit.convert.options import ConvertOptions
from gqakit.convert.refine import REFINE_LR, REFINE_QK_LR
from gqakit.errors import GqakitError

Precision = Literal["auto", "bf16", "fp16", "fp32"]
Trainable = Literal["all", "attention", "kv"]
ObjectiveKind = Literal["lm", "distill", "mix"]
SaveDtype = Literal["auto", "float32", "bfloat16", "float16"]
TxtDocs = Literal["line", "paragraph", "file"]


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
        method: a conversion method (:data:`gqakit.convert.methods.METHODS`): ``mean`` (the paper's),
            ``first``, ``random`` or ``calibrated``.
        seed: seed for ``random``.
        calib_data: calibration text for ``calibrated`` and ``similarity`` (``gqakit convert --calib-data``).
        calib_tokens: calibration tokens.
        grouping: ``contiguous`` or ``similarity`` (:data:`gqakit.convert.methods.GROUPINGS`).
        refine_steps: Adam steps per layer fitting each converted attention block to the original's
            output on ``calib_data`` (``gqakit convert --refine-steps``); 0: off.
        refine_lr: their learning rate.
        refine_qk_lr: the query/key side's learning rate (``--refine-qk-lr``); null: ``refine_lr``.
        refine_target: what each block is fitted to (``--refine-target``,
            :data:`gqakit.convert.refine_names.REFINE_TARGETS`).
        refine_schedule: how the rates change over each layer's steps (``--refine-schedule``,
            :data:`gqakit.convert.refine_names.REFINE_SCHEDULES`).
        refine_loss: how each refinement batch's error is measured (``--refine-loss``,
            :data:`gqakit.convert.refine_names.REFINE_LOSSES`); null: the target's own.

    Every field is the :class:`~gqakit.convert.options.ConvertOptions` field of its name, and is checked
    by its rules (:meth:`options`).
    """

    groups: int
    method: str = "mean"
    seed: int = 0
    calib_data: str | None = None
    calib_tokens: int = 4096
    grouping: str = "contiguous"
    refine_steps: int = 0
    refine_lr: float = REFINE_LR
    refine_qk_lr: float | None = REFINE_QK_LR
    refine_target: str = "attention"
    refine_schedule: str = "constant"
    refine_loss: str | None = None

    def options(self, expand: Callable[[str], str] = str, force: bool = False) -> ConvertOptions:
        """The ``gqakit convert`` options this block asks for, ``calib_data`` passed through ``expand``
        (the recipe's ``${VAR}`` expansion, at run time)."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.calib_data:
            given["calib_data"] = expand(self.calib_data)
        return ConvertOptions(**given, force=force)


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
        val_split: the hub split to validate on (only with ``hub``; with ``files`` use ``val_files``).
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
        precision: ``bf16`` / ``fp16`` mixed precision (fp32 master weights), ``fp32``, or ``auto``: bf16
            where the device has bf16 instructions (a CUDA GPU that supports it, a CPU with AVX-512 BF16
            or AMX), else fp32, decided when the run starts (gqakit.json records what ran).
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
class SpeedConfig:
    """How fast the loop runs; none of it changes what is trained beyond floating-point rounding.

    ``auto`` picks, per device, what was measured fastest (``benchmarks/bench_uptrain.py``, docs/gpu.md);
    a lever the device cannot run is turned off with one log line saying so
    (:func:`gqakit.uptrain.speed.resolve_speed`).

    Attributes:
        fused_loss: the output projection and the loss in one chunked pass that never holds the
            ``[tokens, vocab]`` logits (student and teacher). ``auto``: on a CPU, and on a GPU with
            ``compile`` (eager it is slower there), in one process or DDP.
        compile: ``torch.compile`` each decoder layer (student and teacher). ``auto``: on for CUDA in one
            process or DDP.
        kernels: ``liger`` (liger-kernel's fused RMSNorm, RoPE, SwiGLU; CUDA) or ``none``. ``auto``: none.
        attention: the scaled-dot-product attention backend: ``flash``, ``efficient``, ``cudnn``, ``math``,
            or ``auto`` (PyTorch chooses per call).
        device: where a single-process run trains: ``cpu``, ``cuda``, ``cuda:N``, or ``auto`` (where
            accelerate puts it: CUDA when present). A distributed launch picks its processes' devices
            itself (``accelerate launch --cpu``); ``auto`` only there. The pipelines pass ``--device``.
    """

    fused_loss: bool | Literal["auto"] = "auto"
    compile: bool | Literal["auto"] = "auto"
    kernels: Literal["auto", "liger", "none"] = "auto"
    attention: Literal["auto", "flash", "efficient", "cudnn", "math"] = "auto"
    device: str = "auto"


@dataclass
class EvalConfig:
    """Validation perplexity.

    Attributes:
        every: steps between evaluations (0: only at the start and the end).
        at_steps: further steps to evaluate after, e.g. log-spaced ones for a recovery curve
            (``gqakit recovery``); steps past the budget are ignored.
        at_start: evaluate before the first step (the converted model's perplexity).
        batch_size: blocks per device per forward pass (None: ``train.batch_size``).
    """

    every: int = 0
    at_steps: list[int] = field(default_factory=list)
    at_start: bool = True
    batch_size: int | None = None


@dataclass
class CheckpointConfig:
    """Resumable checkpoints under ``OUTPUT_DIR/checkpoints`` (model, optimizer, RNG, data position).

    Written and read without pickled code (safetensors, ``torch.load(weights_only=True)``, JSON); not
    under DeepSpeed, whose checkpoints only its unpickling loader reads (``every`` must be 0 there).

    Attributes:
        every: steps between checkpoints (0: none, so no ``--resume`` and no rollback).
        keep: how many recent checkpoints to keep (at least 1; ``every: 0`` writes none).
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
        all_ranks: log from every process of a distributed run (default: the main process only; the
            others log errors only and show no progress bars).
    """

    every: int = 1
    tensorboard: bool = True
    progress: bool = True
    all_ranks: bool = False


@dataclass
class Recipe:
    """A complete uptraining run. ``model``, ``data``, ``budget`` and ``output_dir`` are required.

    Attributes:
        model: what to uptrain (and optionally convert first).
        data: training and validation text.
        budget: how long to train.
        output_dir: where the final model, metrics and checkpoints go.
        teacher: the original checkpoint, for ``distill`` / ``mix``; must share the model's vocabulary.
        train, speed, objective, eval, checkpoint, guard, log: see each section.
        seed: seeds model-side randomness and the data order.
    """

    model: ModelConfig
    data: DataConfig
    budget: BudgetConfig
    output_dir: str
    teacher: str | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
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
