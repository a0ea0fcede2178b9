"""The uptraining run, top to bottom: ``uptrain(recipe)`` checks, sets up, trains and saves.

::

    uptrain(recipe, resume, force)
      preflight     every check, before anything is written (gqakit.uptrain.preflight)
      run dir       held by a lock beside it, emptied by --force, recipe.yaml written
      convert       model.convert: the source converted into OUTPUT_DIR/work/converted (once)
      setup         accelerator -> student (frozen as asked, speed levers) -> teacher -> data
                    -> optimizer + schedule -> accelerate.prepare   (--resume: the newest checkpoint)
      train         each step: grad_accum micro-batches (forward, loss, backward) -> clip
                    -> finite? step : skip -> log -> eval every N -> checkpoint every N
      finish        final validation -> gathered full state dict -> HF safetensors + tokenizer + gqakit.json

One process or many (DDP, FSDP2, DeepSpeed, several nodes) is decided by ``accelerate launch`` and its
config file, never here: the loop is accelerate's ``prepare`` / ``accumulate`` / ``backward``. Every
process runs all of it; only the main process writes shared files.

A non-finite loss or gradient norm skips the step (no update); ``guard.max_bad_steps`` in a row roll the
run back to the last checkpoint and go on with the learning rate times ``guard.lr_factor``. A checkpoint
holds the model, optimizer, scaler and RNG states (:mod:`gqakit.uptrain.state_io`: nothing unpickled)
and the counters (:class:`~gqakit.uptrain.state_io.TrainState`); the learning-rate schedule is a function
of the step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from gqakit import __version__
from gqakit.checkpoint import copy_non_weight_files, model_source
from gqakit.console import progress as progress_bar
from gqakit.console import quiet_transformers
from gqakit.convert import convert_checkpoint
from gqakit.dtypes import dtype_name, torch_dtype
from gqakit.errors import GqakitError
from gqakit.families import get_adapter
from gqakit.models import load_causal_lm, load_tokenizer
from gqakit.storage import OWNER, exclusive, write_json, write_text
from gqakit.uptrain.data import Blocks, build_blocks
from gqakit.uptrain.objectives import (
    Objective,
    fused_loss_unsupported,
    install_fused_loss,
    lm_loss_per_sequence,
    teacher_outputs,
)
from gqakit.uptrain.preflight import flat, preflight, process_state, resolve_precision
from gqakit.uptrain.recipe import Recipe, SpeedConfig, expand
from gqakit.uptrain.schedule import Budget, lr_multiplier, resolve_budget, warmup_steps
from gqakit.uptrain.state_io import (
    CHECKPOINTS,
    PROVENANCE,
    TrainState,
    latest_checkpoint,
    load_training_state,
    save_training_state,
)

log = logging.getLogger("gqakit.uptrain")

CONVERTED = Path("work") / "converted"
METRICS = "metrics.jsonl"


@dataclass
class UptrainResult:
    """What an uptraining run produced.

    Attributes:
        output_dir: the run directory; the final model is a Hugging Face checkpoint at its root.
        steps: optimizer steps taken (skipped non-finite steps included).
        tokens: training tokens consumed by those steps (all processes).
        alpha: ``tokens / budget.pretraining_tokens``, or None when the recipe does not state it.
        final_val_ppl: validation perplexity of the final model.
        elapsed_s: wall time of the whole run, conversion included.
        history: the metrics JSONL file (one record per logged step and per evaluation).
        initial_val_ppl: validation perplexity before the first step (None when not measured).
        skipped_steps: steps skipped for a non-finite loss or gradient norm.
        rollbacks: rollbacks to a checkpoint after repeated non-finite steps.
    """

    output_dir: Path
    steps: int
    tokens: int
    alpha: float | None
    final_val_ppl: float
    elapsed_s: float
    history: Path
    initial_val_ppl: float | None = None
    skipped_steps: int = 0
    rollbacks: int = 0


@dataclass
class Run:
    """One run's set-up pieces (:func:`setup`) and its counters: what every function below takes."""

    recipe: Recipe  # with train.precision resolved: what runs
    out: Path
    model_path: str
    acc: Any
    model: Any
    teacher: Any
    speed: SpeedConfig  # resolved: no auto left
    save_dtype: torch.dtype
    tokenizer: Any
    blocks: Blocks
    budget: Budget
    objective: Objective
    optimizer: Any
    train_loader: Any = None
    val_loader: Any = None
    state: TrainState = field(default_factory=TrainState)


# -------------------------------------------------------------------------------------------------- The run


def uptrain(recipe: Recipe, *, resume: bool = False, force: bool = False) -> UptrainResult:
    """Run an uptraining recipe to the end and save the final model.

    Args:
        recipe: a validated recipe (:func:`gqakit.uptrain.recipe.load_recipe`).
        resume: continue the run in ``recipe.output_dir`` from its newest checkpoint (model, optimizer,
            schedule, RNG and data position); starts from the beginning when there is none yet.
        force: delete a non-empty ``recipe.output_dir`` first (ignored with ``resume``).

    Returns:
        An :class:`UptrainResult`; the model is a Hugging Face checkpoint at ``result.output_dir``.

    Raises:
        GqakitError: bad inputs (all listed at once), a non-empty output directory, too little data,
            or a run that stays non-finite after its rollbacks.
    """
    start = time.perf_counter()
    out = Path(expand(recipe.output_dir)).resolve()
    quiet_other_ranks(recipe)
    with hold_run_dir(out):  # first: a run under way is the reason its directory is not empty
        preflight(recipe, resume=resume, force=force)  # everything, before anything is written
        with run_dir(out, resume, force):
            if process_state().is_main_process:
                write_text(out / "recipe.yaml", recipe.to_yaml())
            model_path, conversion = convert_first(recipe, out)
            run = setup(recipe, out, model_path)
            if resume:
                resume_run(run)
            train(run)
            result = finish(run, conversion, start)
    result.elapsed_s = time.perf_counter() - start
    return result


def quiet_other_ranks(recipe: Recipe) -> None:
    """One log per run, not one per process: the other processes report errors only, and show no
    progress bars, unless ``log.all_ranks``."""
    if recipe.log.all_ranks or process_state().is_main_process:
        return
    logging.getLogger("gqakit").setLevel(logging.ERROR)
    quiet_transformers()


@contextlib.contextmanager
def hold_run_dir(out: Path) -> Iterator[None]:
    """Hold the run directory ``out`` for one run: its main process locks ``.OUT.lock`` beside it (beside,
    so that ``--force`` and the emptiness check never see it). When another command holds it, every
    process of this one stops with the holder's pid and command: two runs in one directory would mix
    their checkpoints, and a ``--resume`` of either could read the other's."""
    state = process_state()
    busy = (
        f"output_dir {out} is in use by another run ({OWNER}). Two runs writing one directory would mix "
        "their checkpoints: wait for that run to finish, or choose another output_dir (override "
        "output_dir=DIR)."
    )
    made: list[Path] = []  # the parents this run creates, removed again if it fails
    try:
        with contextlib.ExitStack() as held:
            refused: str | None = None
            if state.is_main_process:
                made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
                try:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    held.enter_context(exclusive(out.parent / f".{out.name}.lock", busy))
                except GqakitError as e:
                    refused = e.message
                except OSError:
                    pass  # a directory that cannot be written: preflight names it, with the fix
            if state.num_processes > 1:  # every rank learns the main process's answer
                # deferred: accelerate takes seconds to import
                from accelerate.utils import broadcast_object_list

                box = [refused]
                broadcast_object_list(box, from_process=0)
                refused = box[0]
            if refused is not None:
                raise GqakitError(refused)
            yield
    except BaseException:
        for p in made:  # innermost first; a directory something else was written into stays
            try:
                p.rmdir()
            except OSError:
                break
        raise


@contextlib.contextmanager
def run_dir(out: Path, resume: bool, force: bool) -> Iterator[None]:
    """Create the run directory (``force``: empty it first), in the main process, once every process has
    checked it (:func:`~gqakit.uptrain.preflight.preflight`).

    A new run that fails before its first checkpoint deletes it again, so that the same command can simply
    be run again (no --force). It is kept when it holds something to resume from: a checkpoint, or a
    finished conversion (``--resume`` reuses it instead of converting again).
    """
    state = process_state()
    busy = out.is_dir() and any(out.iterdir())
    state.wait_for_everyone()
    if state.is_main_process:
        if busy and force and not resume:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    try:
        yield
    except BaseException:
        keep = (
            resume
            or (busy and not force)
            or any((out / CHECKPOINTS).glob("step-*"))
            or (out / CONVERTED / PROVENANCE).is_file()
            or (out / PROVENANCE).is_file()  # a finished model (a failure after saving it)
        )
        if state.is_main_process and not keep:
            shutil.rmtree(out, ignore_errors=True)
        raise


def convert_first(recipe: Recipe, out: Path) -> tuple[str, dict[str, Any]]:
    """The checkpoint to train and its conversion record: ``model.path`` converted into
    ``OUTPUT_DIR/work/converted`` when the recipe has ``model.convert`` (once; a resumed run reuses it),
    calibrating where the run trains unless the block names a device."""
    c = recipe.model.convert
    if c is None:
        path = model_source(expand(recipe.model.path))  # an asset name or a .gguf too, as every SRC
    else:
        path = str(out / CONVERTED)
        state = process_state()
        if state.is_main_process and not (out / CONVERTED / PROVENANCE).is_file():
            log.info("converting %s to %d K/V head(s) into %s", recipe.model.path, c.groups, path)
            device = c.device if c.device != "auto" else recipe.speed.device
            convert_checkpoint(recipe.model.path, path, replace(c, device=device, force=True))
        state.wait_for_everyone()
    record = Path(path) / PROVENANCE  # a checkpoint converted by gqakit: keep its conversion record
    return path, ({"convert": json.loads(record.read_text())} if record.is_file() else {})


# ---------------------------------------------------------------------------------------------------- Setup


def setup(recipe: Recipe, out: Path, model_path: str) -> Run:
    """Everything the loop needs before its first step, in order; logs what the run is."""
    # ``auto`` becomes what this machine runs, once: every step, evaluation and record then agree
    precision = resolve_precision(recipe.train.precision, recipe.speed.device)
    recipe = replace(recipe, train=replace(recipe.train, precision=precision))
    acc = make_accelerator(recipe, out)
    model, speed, save_dtype = load_student(recipe, model_path, acc)
    teacher = load_teacher(recipe, acc, speed)
    tokenizer, blocks, train_loader, val_loader = load_data(recipe, model_path, acc)
    t = recipe.train
    budget = resolve_budget(recipe.budget, t.batch_size * t.grad_accum * acc.num_processes * blocks.seq_len)
    o = recipe.objective
    # the fused loss's chunk products run in the autocast dtype
    autocast = None if t.precision == "fp32" else torch_dtype(t.precision)
    objective = Objective(o.kind, o.temperature, o.distill_weight, compute_dtype=autocast)
    run = Run(
        recipe, out, model_path, acc, model, teacher, speed, save_dtype, tokenizer, blocks, budget,
        objective, optimizer=make_optimizer(t, model),
    )  # fmt: skip
    # No scheduler: each step sets its learning rate from the step (set_lr). Nothing is registered with
    # accelerate for checkpointing: gqakit writes and reads its checkpoints itself (gqakit.uptrain.state_io).
    run.model, run.optimizer, run.train_loader, run.val_loader = acc.prepare(
        model, run.optimizer, train_loader, val_loader
    )
    if acc.log_with:
        scalars = {
            k: v if isinstance(v, int | float | str | bool) else str(v)
            for k, v in flat(recipe.to_dict()).items()
        }
        acc.init_trackers("uptrain", config=scalars)
    log.info(
        "data: %d train / %d validation blocks of %d tokens from %s",
        len(blocks.train), len(blocks.val), blocks.seq_len, blocks.source,
    )  # fmt: skip
    log.info("budget: %s; %s tokens per step", budget.describe(), f"{budget.tokens_per_step:,}")
    return run


def make_accelerator(recipe: Recipe, out: Path):
    """The ``Accelerator`` of this process: precision, exact gradient accumulation, a seeded data order,
    trackers; the process placed on ``speed.device`` and seeded."""
    # deferred: accelerate takes seconds to import
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import (
        DataLoaderConfiguration,
        GradientAccumulationPlugin,
        ProjectConfiguration,
        set_seed,
    )

    r = recipe
    # The accelerator state is a process-wide singleton that refuses a second, different precision, and
    # one process may run several recipes (a notebook, the demo, tests): start it afresh. The process
    # group (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    process_state(r.speed.device)  # a single process on the recipe's device (auto: accelerate's)
    tensorboard = r.log.tensorboard and (
        importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
    )
    try:
        acc = Accelerator(
            mixed_precision="no" if r.train.precision == "fp32" else r.train.precision,
            # Exactly grad_accum micro-batches per step, also across an epoch boundary.
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=r.train.grad_accum, sync_with_dataloader=False, adjust_scheduler=False
            ),
            # The data order depends on the seed and the epoch only, so a resumed run sees the same.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=r.seed),
            log_with=["tensorboard"] if tensorboard else None,
            project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "tb")),
        )
    except ValueError as e:  # e.g. bf16 on a GPU without it
        raise GqakitError(f"train.precision={r.train.precision} cannot run here: {e}") from None
    set_seed(r.seed)
    return acc


def load_student(recipe: Recipe, model_path: str, acc: Any) -> tuple[Any, SpeedConfig, torch.dtype]:
    """The model to train in float32 master weights (bf16/fp16 are autocast by accelerate), frozen as
    ``train.trainable`` says, with the speed levers this device runs; and the dtype to save it in."""
    r = recipe
    model = load_causal_lm(model_path, device="cpu")  # in its own dtype; accelerate.prepare places it
    save_dtype = model.dtype if r.model.save_dtype == "auto" else torch_dtype(r.model.save_dtype)
    model.float()  # float32 master weights; bf16/fp16 are autocast by accelerate
    n_trainable, n_params = apply_trainable(model, r.train.trainable)
    if r.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    speed, said = resolve_speed(r.speed, acc.device.type, acc.distributed_type.value, model)
    log.info(
        "uptrain %s: %s trainable of %s parameters (%s); %s processes (%s), precision %s",
        model_path, f"{n_trainable:,}", f"{n_params:,}", r.train.trainable, acc.num_processes,
        acc.distributed_type.value, r.train.precision,
    )  # fmt: skip
    log.info(said)
    speed_up(model, speed)
    if speed.fused_loss:
        install_fused_loss(model)
    return model, speed, save_dtype


def apply_trainable(model: torch.nn.Module, mode: str) -> tuple[int, int]:
    """Freeze every parameter that ``train.trainable`` does not train: ``all`` (the paper), ``attention``
    (the attention blocks) or ``kv`` (the K/V projections, a fused qkv projection whole, and the norms
    regrouped with them), located by the family's adapter. Returns (trainable, total) parameter counts.

    Raises:
        GqakitError: the family has no adapter (for ``attention`` / ``kv``), or nothing matched.
    """
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    if mode == "all":
        for p in params.values():
            p.requires_grad_(True)
        return total, total
    model_type = getattr(model.config, "model_type", "")
    a = get_adapter(model_type)
    # ``model.layers.{layer}.self_attn.k_proj`` -> a regex matching its parameters
    templates = (
        [a.o.rsplit(".", 1)[0]]
        if mode == "attention"
        else [a.k, a.v, a.qkv, a.k_norm_flat, a.k_norm_per_head]
    )
    patterns = [
        re.escape(t).replace(r"\{layer\}", r"\d+").replace(r"\{head\}", r"\d+") + r"\."
        for t in templates
        if t
    ]
    regex = re.compile("|".join(patterns))
    chosen = 0
    for name, p in params.items():
        p.requires_grad_(bool(regex.match(name)))
        chosen += p.numel() if p.requires_grad else 0
    if chosen == 0:
        raise GqakitError(
            f"train.trainable={mode} matched no parameter of this {model_type} model (first names: "
            f"{', '.join(list(params)[:3])}). Use train.trainable=all."
        )
    return chosen, total


def load_teacher(recipe: Recipe, acc: Any, speed: SpeedConfig) -> Any:
    """The frozen teacher of ``distill`` / ``mix`` in the run's precision on its device; None for ``lm``."""
    r = recipe
    if r.objective.kind == "lm":
        if r.teacher:
            log.warning("teacher %s is not used: objective.kind is lm", r.teacher)
        return None
    teacher = load_causal_lm(r.teacher, dtype=dtype_name(r.train.precision), device=str(acc.device))
    teacher.requires_grad_(False)
    speed_up(teacher, speed)
    why = fused_loss_unsupported(teacher) if speed.fused_loss else None
    if why:
        raise GqakitError(
            f"speed.fused_loss cannot use the teacher {r.teacher}: {why}. Set speed.fused_loss=false."
        )
    return teacher


def load_data(recipe: Recipe, model_path: str, acc: Any) -> tuple[Any, Blocks, DataLoader, DataLoader]:
    """The tokenizer, the packed blocks (tokenized once, by the main process first) and their loaders."""
    r = recipe
    tokenizer = load_tokenizer(model_path)
    with acc.main_process_first():
        blocks = build_blocks(r.data, tokenizer, r.seed)
    world = acc.num_processes
    if len(blocks.train) < r.train.batch_size * world:
        raise GqakitError(
            f"The training text gives {len(blocks.train)} block(s) of {r.data.seq_len} tokens, fewer than "
            f"one batch (train.batch_size={r.train.batch_size} x {world} process(es)). Add text, or lower "
            "data.seq_len or train.batch_size."
        )
    train_loader = DataLoader(blocks.train, batch_size=r.train.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(blocks.val, batch_size=r.eval.batch_size or r.train.batch_size)
    return tokenizer, blocks, train_loader, val_loader


def make_optimizer(t: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, weight decay on matrices only (not norms or biases)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    try:  # the fused kernel (CPU and GPU) is the fastest AdamW, and what HF Trainer uses by default
        return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps)


def set_lr(run: Run) -> float:
    """Put this step's learning rate into the optimizer and return it: ``train.lr`` times the warmup and
    cosine multiplier of the step, times the guard's scale. A function of the step, so a resume or a
    rollback needs no scheduler state."""
    t, steps = run.recipe.train, run.budget.steps
    warmup = warmup_steps(t.warmup_fraction, steps)
    lr = t.lr * lr_multiplier(run.state.step, steps, warmup, t.min_lr_ratio) * run.state.lr_scale
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    return lr


# --- Speed levers: each recipe option under ``speed:``, ``auto`` resolved per device (docs/uptrain.md#speed)


def resolve_speed(
    cfg: SpeedConfig, device_type: str, distributed_type: str, model: torch.nn.Module
) -> tuple[SpeedConfig, str]:
    """The levers this run uses (no ``auto`` left) and the log line saying what runs and what is off.

    ``auto`` is what was measured fastest (benchmarks/bench_uptrain.py): on a CUDA GPU in one process or
    DDP, ``compile`` and with it the fused loss (eager, the fused loss's chunk loop costs more than it
    saves there; liger's kernels stop compile's own fusions, so they stay off); on a CPU the fused loss
    alone (compiling costs more than short CPU runs gain); under FSDP and DeepSpeed nothing (not measured
    there). An explicit lever the device cannot run is turned off with the reason.
    """
    cuda = device_type == "cuda"
    simple = distributed_type in ("NO", "MULTI_GPU", "MULTI_CPU")
    off: list[str] = []
    compile_ = cfg.compile is True or (cfg.compile == "auto" and cuda and simple)
    if cfg.compile == "auto" and not compile_:
        off.append("compile (auto: on for CUDA in one process or DDP only)")
    fused = cfg.fused_loss is True or (cfg.fused_loss == "auto" and simple and (compile_ or not cuda))
    reason = fused_loss_unsupported(model) if fused else None
    if reason:
        off.append(f"fused loss ({reason})")
    elif cfg.fused_loss == "auto" and not simple:
        off.append(f"fused loss (auto: not measured under {distributed_type}; set speed.fused_loss=true)")
    kernels = "none"
    if cfg.kernels == "liger" and not cuda:
        off.append("kernels liger (needs a CUDA GPU)")
    elif cfg.kernels == "liger" and importlib.util.find_spec("liger_kernel") is None:
        off.append("kernels liger (not installed: pip install liger-kernel)")
    elif cfg.kernels == "liger":
        kernels = "liger"
    speed = SpeedConfig(fused_loss=fused and not reason, compile=compile_, kernels=kernels, device=cfg.device)
    on = [n for n, v in (("fused loss", speed.fused_loss), ("compile", compile_)) if v]
    on += ["kernels liger"] if kernels == "liger" else []
    said = "speed: " + (", ".join(on) if on else "plain eager loop")
    return speed, said + ("; off: " + "; ".join(off) if off else "")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder blocks: modules of the classes transformers will not split."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def speed_up(model: torch.nn.Module, speed: SpeedConfig) -> None:
    """Liger's fused RMSNorm/RoPE/SwiGLU kernels, then ``torch.compile`` of each decoder layer in place
    (one compiled graph serves every layer; parameter names and checkpoints are unchanged)."""
    if speed.kernels == "liger":
        # deferred: liger-kernel is optional (CUDA only)
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(  # (its loss is gqakit's fused loss)
            model,
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=False,
        )
    if speed.compile:
        for layer in decoder_layers(model):
            layer.compile()


# ------------------------------------------------------------------------------------------------- Training


def train(run: Run) -> None:
    """Train from ``run.state.step`` to the budget (the final evaluation is :func:`finish`'s)."""
    r, acc, s, budget = run.recipe, run.acc, run.state, run.budget
    if r.eval.at_start and s.step == 0 and s.initial_val_ppl is None:
        loss, s.initial_val_ppl = evaluate(acc, run.model, run.val_loader)
        log_eval(run, loss, s.initial_val_ppl)
    micro_batches = batches(run)
    bar = progress_bar(
        desc="uptrain", total=budget.steps, enabled=acc.is_local_main_process and r.log.progress, unit="step",
        leave=True, initial=s.step,
    )  # fmt: skip
    max_norm = r.train.max_grad_norm or float("inf")
    bad_streak = 0
    eval_at = set(r.eval.at_steps)
    start, start_step = time.perf_counter(), s.step
    while s.step < budget.steps:
        t0 = time.perf_counter()
        lr = set_lr(run)
        # Loss, lm, kl summed over micro-batches, then averaged over micro-batches and processes.
        sums = torch.zeros(3, device=acc.device)
        for _ in range(r.train.grad_accum):
            batch = next(micro_batches)
            with acc.accumulate(run.model):
                loss, parts = loss_step(run, batch)
                acc.backward(loss)
            zero = sums.new_zeros(())
            sums += torch.stack([loss.detach().float(), parts.get("lm", zero), parts.get("kl", zero)])
        grad_norm = acc.clip_grad_norm_(run.model.parameters(), max_norm)
        stats = acc.reduce(sums / r.train.grad_accum, reduction="mean")
        # fp16's grad scaler skips an overflowing step by itself; only the loss counts then.
        # (DeepSpeed clips inside its engine and may report the norm as a float, or not at all.)
        norm_ok = grad_norm is None or r.train.precision == "fp16" or math.isfinite(float(grad_norm))
        if bool(torch.isfinite(stats).all()) and norm_ok:
            run.optimizer.step()
            bad_streak = 0
        else:
            # optimizer.step() would have called the fp16 grad scaler's update(); without it the next
            # step's clip_grad_norm_ unscales again and torch raises. update() also lowers the scale when
            # this step's gradients overflowed.
            if acc.scaler is not None:
                acc.scaler.update()
            bad_streak += 1
            s.skipped += 1
            log.warning(
                "step %d: non-finite loss or gradient norm, skipped (%d in a row)", s.step, bad_streak
            )
        run.optimizer.zero_grad(set_to_none=True)
        s.step += 1
        if bad_streak >= r.guard.max_bad_steps:
            rollback(run)
            bad_streak = 0
            bar.n = s.step
            continue

        tok_s = budget.tokens_per_step / (time.perf_counter() - t0)
        bar.update(1)
        bar.set_postfix(loss=f"{stats[0].item():.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
        if s.step % r.log.every == 0 or s.step == budget.steps:
            log_train(run, stats, grad_norm, lr, tok_s, s.step - start_step, time.perf_counter() - start)
        due = (r.eval.every and s.step % r.eval.every == 0) or s.step in eval_at
        if due and s.step < budget.steps:  # the last step is evaluated by finish()
            log_eval(run, *evaluate(acc, run.model, run.val_loader))
        if r.checkpoint.every and s.step % r.checkpoint.every == 0 and s.step < budget.steps:
            save_checkpoint(run)
    bar.close()


def batches(run: Run) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches forever, epoch after epoch, starting at the saved data position."""
    loader = run.train_loader
    epoch, skip = divmod(run.state.batches_seen, len(loader))
    while True:
        loader.set_epoch(epoch)
        for batch in run.acc.skip_first_batches(loader, skip) if skip else loader:
            run.state.batches_seen += 1
            yield batch
        epoch, skip = epoch + 1, 0


def loss_step(run: Run, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective on one micro-batch: the loss to back-propagate and its parts (``lm``, ``kl``)."""
    ids = batch["input_ids"]
    teacher = None
    if run.teacher is not None:
        with torch.no_grad(), run.acc.autocast():
            if run.speed.fused_loss:  # its last hidden states and output projection
                teacher = teacher_outputs(run.teacher, ids)
            else:
                teacher = run.teacher(input_ids=ids, use_cache=False).logits
    if run.speed.fused_loss:  # logits never materialised (objectives.fused_linear_loss)
        return run.model(input_ids=ids, loss_spec=run.objective, teacher=teacher)
    return run.objective(run.model(input_ids=ids, use_cache=False).logits, ids, teacher)


@torch.no_grad()
def evaluate(acc: Any, model: Any, val_loader: Any) -> tuple[float, float]:
    """Mean validation loss and perplexity over every validation block, all processes together."""
    model.eval()
    losses = []
    for batch in val_loader:
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        losses.append(acc.gather_for_metrics(lm_loss_per_sequence(logits, batch["input_ids"])))
    model.train()
    loss = torch.cat(losses).mean().item()
    return loss, math.exp(min(loss, 700.0))


# ------------------------------- Records: metrics.jsonl (main process), TensorBoard when installed, the log


def log_train(
    run: Run, stats: torch.Tensor, grad_norm: Any, lr: float, tok_s: float, steps_here: int, elapsed: float
) -> None:
    s, b, kind = run.state, run.budget, run.recipe.objective.kind
    record: dict[str, Any] = {"step": s.step, "tokens": b.tokens(s.step), "alpha": b.alpha(s.step)}
    record["loss"] = stats[0].item()
    if kind in ("lm", "mix"):
        record["lm"] = stats[1].item()
    if kind in ("distill", "mix"):
        record["kl"] = stats[2].item()
    record.update(
        lr=lr,
        grad_norm=None if grad_norm is None else float(grad_norm),
        tokens_per_s=tok_s,
        avg_tokens_per_s=steps_here * b.tokens_per_step / max(elapsed, 1e-9),
    )
    write_record(run, record)
    run.acc.log({f"train/{k}": v for k, v in record.items() if isinstance(v, float | int)}, step=s.step)


def log_eval(run: Run, loss: float, ppl: float) -> None:
    s, b = run.state, run.budget
    record = {"step": s.step, "tokens": b.tokens(s.step), "alpha": b.alpha(s.step)}
    write_record(run, {**record, "val_loss": loss, "val_ppl": ppl})
    run.acc.log({"val/loss": loss, "val/ppl": ppl}, step=s.step)
    log.info("%s: validation loss %.4f, perplexity %.3f", b.progress(s.step), loss, ppl)


def write_record(run: Run, record: dict[str, Any]) -> None:
    """Append one JSON line to ``metrics.jsonl`` (main process)."""
    if run.acc.is_main_process:
        with open(run.out / METRICS, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def truncate_records(run: Run, step: int) -> None:
    """Drop the records past ``step`` (a resumed run writes them again), and a line a kill cut short."""
    path = run.out / METRICS
    if run.acc.is_main_process and path.is_file():

        def record_step(line: str) -> float:  # infinity for a line that is not a whole record
            try:
                value = json.loads(line).get("step", 0)
            except (json.JSONDecodeError, AttributeError):
                return math.inf
            return value if isinstance(value, int | float) else math.inf

        keep = [ln for ln in path.read_text().splitlines() if record_step(ln) <= step]
        write_text(path, "".join(ln + "\n" for ln in keep))  # atomically: a kill keeps the records whole


def read_history(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``: training steps (``loss``...), evaluations (``val_ppl``)."""
    path = Path(output_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------- Checkpoints, resume and rollback


def save_checkpoint(run: Run) -> None:
    """``checkpoints/step-NNNNNNNN``, written into a hidden directory and renamed into place (a kill
    leaves a whole checkpoint or none); only the newest ``checkpoint.keep`` stay."""
    acc, step = run.acc, run.state.step
    root = run.out / CHECKPOINTS
    final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.partial"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    extra = {"tokens": run.budget.tokens(step), "processes": acc.num_processes}
    save_training_state(acc, run.model, run.optimizer, tmp, {**asdict(run.state), **extra})
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(root.glob("step-*"))[: -run.recipe.checkpoint.keep or None]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()


def load_checkpoint(run: Run, path: Path, counters: bool = True) -> None:
    """Restore the model, optimizer, scaler and RNG and the counters; with ``counters=False`` only the
    step comes back (a rollback keeps its counters)."""
    record = load_training_state(run.acc, run.model, run.optimizer, path)
    if counters:
        run.state = TrainState(**{k: record[k] for k in asdict(run.state)})
    else:
        run.state.step = record["step"]
    # accelerate counts micro-steps to know when gradients sync; a step is grad_accum of them.
    run.acc.step = run.state.step * run.recipe.train.grad_accum


def resume_run(run: Run) -> None:
    """Restore the newest checkpoint (model, optimizer, schedule, RNG, data position), if there is one."""
    ckpt = latest_checkpoint(run.out)
    if ckpt is None:
        log.info("no checkpoint in %s yet: starting from the beginning", run.out / CHECKPOINTS)
        truncate_records(run, -1)  # a run killed before its first checkpoint logged steps
        return
    load_checkpoint(run, ckpt)
    truncate_records(run, run.state.step)
    log.info("resumed from %s: %s", ckpt, run.budget.progress(run.state.step))


def rollback(run: Run) -> None:
    """Back to the last checkpoint after ``guard.max_bad_steps`` non-finite steps in a row: weights,
    optimizer, schedule and RNG come back; the data position and the counters go on, and the learning
    rate drops by ``guard.lr_factor``."""
    g, s = run.recipe.guard, run.state
    ckpt = latest_checkpoint(run.out)
    if ckpt is None:
        raise GqakitError(
            f"{g.max_bad_steps} non-finite steps in a row at step {s.step} and no checkpoint to roll back "
            f"to. Lower train.lr (now {run.recipe.train.lr:g}), or set checkpoint.every so the guard can "
            "roll back."
        )
    if s.rollbacks >= g.max_rollbacks:
        raise GqakitError(
            f"Still non-finite after {s.rollbacks} rollback(s) (learning rate x{s.lr_scale:g}) at step "
            f"{s.step}. Lower train.lr, raise train.warmup_fraction, or use train.precision=fp32/bf16."
        )
    load_checkpoint(run, ckpt, counters=False)
    s.lr_scale, s.rollbacks = s.lr_scale * g.lr_factor, s.rollbacks + 1
    log.warning("rolled back to %s; learning rate now x%g", ckpt.name, s.lr_scale)
    # The steps past the checkpoint are run again, as after a resume: their records go, so the history
    # holds each step once (the rollback record says what happened).
    truncate_records(run, s.step)
    write_record(run, {"step": s.step, "event": "rollback", "checkpoint": ckpt.name, "lr_scale": s.lr_scale})


# ----------------------------------------------------------------------------------------------- The result


def finish(run: Run, conversion: dict[str, Any], start: float) -> UptrainResult:
    """Evaluate the final model, save it with its provenance, and say what the run did."""
    r, b, s, acc = run.recipe, run.budget, run.state, run.acc
    val_loss, val_ppl = evaluate(acc, run.model, run.val_loader)
    log_eval(run, val_loss, val_ppl)
    elapsed = time.perf_counter() - start
    provenance = {
        "tool": "gqakit",
        "version": __version__,
        "command": "uptrain",
        "trained": run.model_path,
        **conversion,
        "teacher": r.teacher if run.teacher is not None else None,
        "steps": s.step,
        "tokens": b.tokens(s.step),
        "alpha": b.alpha(s.step),
        "initial_val_ppl": s.initial_val_ppl,
        "final_val_ppl": val_ppl,
        "final_val_loss": val_loss,
        "val_blocks": len(run.blocks.val),
        "data": run.blocks.source,
        "processes": acc.num_processes,
        "distributed_type": acc.distributed_type.value,
        "precision": r.train.precision,
        "skipped_steps": s.skipped,
        "rollbacks": s.rollbacks,
        "elapsed_s": round(elapsed, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "recipe": r.to_dict(),
    }
    save_final(run, provenance)
    acc.end_training()
    same = {f.name for f in fields(UptrainResult)} & provenance.keys()  # steps, tokens, alpha...
    return UptrainResult(output_dir=run.out, history=run.out / METRICS, **{k: provenance[k] for k in same})


def save_final(run: Run, provenance: dict[str, Any]) -> None:
    """Write the final model at the run directory's root: safetensors, config, tokenizer, gqakit.json.

    Under FSDP and DeepSpeed the full state dict is gathered by ``accelerator.get_state_dict``; only the
    main process writes. Files go to a temporary directory first and are moved into place with
    ``gqakit.json`` last, whose presence marks a finished run.
    """
    acc = run.acc
    acc.wait_for_everyone()
    state_dict = acc.get_state_dict(run.model)
    if acc.is_main_process:
        model = acc.unwrap_model(run.model)
        tmp = run.out / ".final.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        state_dict = {k: v.to(run.save_dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        model.config.use_cache = True
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        # save_pretrained records the dtype of the float32 master weights; the file holds save_dtype,
        # which from_pretrained(dtype="auto") must read back.
        model.config.dtype = run.save_dtype
        model.config.save_pretrained(tmp)
        copy_non_weight_files(Path(run.model_path), tmp)
        run.tokenizer.save_pretrained(tmp)
        write_json(tmp / PROVENANCE, provenance)
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == PROVENANCE):
            os.replace(item, run.out / item.name)
        tmp.rmdir()
        if not run.recipe.checkpoint.keep_after_finish:
            shutil.rmtree(run.out / CHECKPOINTS, ignore_errors=True)
    acc.wait_for_everyone()


def validation_perplexity(recipe: Recipe, model_path: str) -> tuple[float, int]:
    """``model_path``'s perplexity on ``recipe``'s validation blocks, measured exactly as a run measures
    its evaluations (same blocks, precision, batch and reduction): the reference a run's evaluations are
    read against, e.g. the original model of a recovery curve. One process.

    Returns:
        The perplexity and the number of validation blocks.
    """
    precision = resolve_precision(recipe.train.precision, recipe.speed.device)
    recipe = replace(recipe, train=replace(recipe.train, precision=precision))
    with tempfile.TemporaryDirectory(prefix="gqakit-val-") as tmp:
        acc = make_accelerator(recipe, Path(tmp))
        model, _, _ = load_student(recipe, model_path, acc)
        _, blocks, _, val_loader = load_data(recipe, model_path, acc)
        model, val_loader = acc.prepare(model, val_loader)
        ppl = evaluate(acc, model, val_loader)[1]
        acc.end_training()
        return ppl, len(blocks.val)
