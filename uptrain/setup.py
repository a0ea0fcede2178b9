"""The run's named setup helpers: its directory (held, made, emptied), the accelerator, the student
(frozen as asked, with the speed levers this device runs), the teacher, the data and the optimizer,
gathered into a :class:`Run` by :func:`setup`.
The run itself reads top to bottom in :mod:`gqakit.uptrain.train`."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from gqakit.dtypes import dtype_name, torch_dtype
from gqakit.errors import GqakitError
from gqakit.families import get_adapter
from gqakit.locks import OWNER, exclusive
from gqakit.models import load_causal_lm, load_tokenizer
from gqakit.storage import make_dirs, remove_new_empty
from gqakit.uptrain.checkpoints import CHECKPOINTS, CONVERTED, PROVENANCE, TrainState
from gqakit.uptrain.data import Blocks, build_blocks
from gqakit.uptrain.objectives import Objective, fused_loss_unsupported, install_fused_loss
from gqakit.uptrain.preflight import process_state, resolve_precision
from gqakit.uptrain.recipe_schema import Recipe, SpeedConfig
from gqakit.uptrain.schedule import Budget, resolve_budget

log = logging.getLogger("gqakit.uptrain")


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


@contextlib.contextmanager
def run_dir(out: Path, resume: bool, force: bool, check: Callable[[], None]) -> Iterator[None]:
    """Hold the run directory ``out`` for one run, ``check()`` it (the preflight), and create it (``force``:
    empty it first) in the main process once every process has checked it.

    Held first (a run under way is the reason its directory is not empty): the main process locks
    ``.OUT.lock`` beside it (beside, so that ``--force`` and the emptiness check never see it). When another
    command holds it, every process of this one stops with the holder's pid and command: two runs in one
    directory would mix their checkpoints, and a ``--resume`` of either could read the other's. A new run
    that fails before its first checkpoint deletes the directory again, so that the same command can
    simply be run again; it is kept when it holds something to resume from (a checkpoint, or a finished
    conversion, which ``--resume`` reuses)."""
    state = process_state()
    busy = (
        f"output_dir {out} is in use by another run ({OWNER}). Two runs writing one directory would mix "
        "their checkpoints: wait for that run to finish, or choose another output_dir (override "
        "output_dir=DIR)."
    )
    try:
        with contextlib.ExitStack() as held:
            refused: str | None = None
            if state.is_main_process:
                try:
                    make_dirs(out.parent)
                    held.enter_context(exclusive(out.parent / f".{out.name}.lock", busy))
                except GqakitError as e:
                    refused = e.message
                except OSError:
                    pass  # a directory that cannot be written: preflight names it, with the fix
            # deferred: accelerate takes seconds to import
            from accelerate.utils import broadcast_object_list

            (refused,) = broadcast_object_list([refused], from_process=0)  # every rank: the main's answer
            if refused is not None:
                raise GqakitError(refused)
            check()
            emptied = force and not resume and out.is_dir() and any(out.iterdir())
            state.wait_for_everyone()
            if state.is_main_process:
                if emptied:
                    shutil.rmtree(out)
                out.mkdir(parents=True, exist_ok=True)
            state.wait_for_everyone()
            try:
                yield
            except BaseException:
                keep = (
                    resume
                    or any((out / CHECKPOINTS).glob("step-*"))
                    or (out / CONVERTED / PROVENANCE).is_file()
                    or (out / PROVENANCE).is_file()  # a finished model (a failure after saving it)
                )
                if state.is_main_process and not keep:
                    shutil.rmtree(out, ignore_errors=True)
                raise
    except BaseException:
        remove_new_empty()  # the parents this run made, still empty
        raise


def setup(recipe: Recipe, out: Path, model_path: str) -> Run:
    """Everything the loop needs before its first step, in order: the accelerator, the student, the
    teacher, the data (its loaders), the budget, the objective and the optimizer; logs what the run is."""
    # ``auto`` becomes what this machine runs, once: every step, evaluation and record then agree
    precision = resolve_precision(recipe.train.precision, recipe.speed.device)
    recipe = replace(recipe, train=replace(recipe.train, precision=precision))
    acc = make_accelerator(recipe)
    model, speed, save_dtype = load_student(recipe, model_path, acc)
    teacher = load_teacher(recipe, acc, speed)
    t, tokenizer = recipe.train, load_tokenizer(model_path)
    with acc.main_process_first():  # tokenized once, by the main process first (counted by preflight)
        blocks = build_blocks(recipe.data, tokenizer, recipe.seed)
    train_loader = DataLoader(blocks.train, batch_size=t.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(blocks.val, batch_size=recipe.eval.batch_size or t.batch_size)
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
    # accelerate for checkpointing: gqakit writes and reads its checkpoints itself (checkpoints.py).
    if sharded_here(acc):  # sharded already (shard): accelerate would wrap it in DDP, which refuses DTensors
        run.model = acc.prepare_model(model, evaluation_mode=True)
        run.optimizer, run.train_loader, run.val_loader = acc.prepare(run.optimizer, train_loader, val_loader)
    else:
        run.model, run.optimizer, run.train_loader, run.val_loader = acc.prepare(
            model, run.optimizer, train_loader, val_loader
        )
    log.info(
        "data: %d train / %d validation blocks of %d tokens from %s",
        len(blocks.train), len(blocks.val), blocks.seq_len, blocks.source,
    )  # fmt: skip
    log.info("budget: %s; %s tokens per step", budget.describe(), f"{budget.tokens_per_step:,}")
    return run


def make_accelerator(recipe: Recipe):
    """The ``Accelerator`` of this process: precision, exact gradient accumulation, a seeded data order;
    the process placed on ``speed.device`` and seeded."""
    # deferred: accelerate takes seconds to import
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed

    r = recipe
    # The accelerator state is a process-wide singleton that refuses a second, different precision, and
    # one process may run several recipes (a notebook, the demo, tests): start it afresh. The process
    # group (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    process_state(r.speed.device)  # a single process on the recipe's device (auto: accelerate's)
    # (bf16 on a GPU without it: refused by preflight)
    acc = Accelerator(
        mixed_precision="no" if r.train.precision == "fp32" else r.train.precision,
        # Exactly grad_accum micro-batches per step, also across an epoch boundary.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=r.train.grad_accum, sync_with_dataloader=False, adjust_scheduler=False
        ),
        # The data order depends on the seed and the epoch only, so a resumed run sees the same.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=r.seed),
    )
    set_seed(r.seed)
    return acc


def load_student(recipe: Recipe, model_path: str, acc: Any) -> tuple[Any, SpeedConfig, torch.dtype]:
    """The model to train in float32 master weights (bf16 is autocast by accelerate), frozen as
    ``train.trainable`` says, with the speed levers this device runs; and the dtype to save it in."""
    r = recipe
    model = load_causal_lm(model_path, device="cpu")  # in its own dtype; accelerate.prepare places it
    save_dtype = model.dtype if r.model.save_dtype == "auto" else torch_dtype(r.model.save_dtype)
    model.float()  # float32 master weights; bf16 is autocast by accelerate
    n_trainable, n_params = apply_trainable(model, r.train.trainable)
    if r.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    speed, said = resolve_speed(r.speed, acc.device.type, distributed_kind(acc), model)
    log.info(
        "uptrain %s: %s trainable of %s parameters (%s); %s processes (%s on %s), precision %s",
        model_path, f"{n_trainable:,}", f"{n_params:,}", r.train.trainable, acc.num_processes,
        distributed_kind(acc), acc.device.type, r.train.precision,
    )  # fmt: skip
    log.info(said)
    speed_up(model, speed)
    if speed.fused_loss:
        install_fused_loss(model)
    if sharded_here(acc):
        shard(model, acc)
    return model, speed, save_dtype


def sharded_here(acc: Any) -> bool:
    """An FSDP launch whose processes run on the CPU. accelerate's FSDP plugin runs on GPUs only: such a
    launch gets a plain MULTI_CPU state (DDP), so gqakit shards the model itself (:func:`shard`)."""
    # deferred: accelerate takes seconds to import
    from accelerate.utils import parse_flag_from_env

    return acc.distributed_type.value == "MULTI_CPU" and parse_flag_from_env("ACCELERATE_USE_FSDP")


def distributed_kind(acc: Any) -> str:
    """How the run is distributed, as logged and recorded: FSDP for gqakit's own sharding on CPUs too."""
    return "FSDP" if sharded_here(acc) else acc.distributed_type.value


def shard(model: torch.nn.Module, acc: Any) -> None:
    """FSDP2 by torch's ``fully_shard``: each decoder layer one unit, then the rest of the model, over
    every process of the run on its device (gloo on CPUs). Each process then holds 1/N of each parameter
    (and of its gradient and optimizer state), and gathers a layer's whole weights only while it runs."""
    # deferred: torch.distributed's FSDP modules load only for a sharded run
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if acc.device.type == "cpu":
        # glibc raises its mmap threshold to the size of each large block freed, so the layer weights FSDP
        # gathers and frees again at every forward and backward end up in the heap, which keeps them:
        # measured, a process's memory grew to hold the whole model again. Fixed at 128 KiB, every block
        # over it goes back to the system when freed. (Not glibc: nothing to do.)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD, fixed from then on
    mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    # torch keeps the root's weights gathered after forward, for backward; a frozen model has none
    fully_shard(model, mesh=mesh, reshard_after_forward=None if model.training else True)


def apply_trainable(model: torch.nn.Module, mode: str) -> tuple[int, int]:
    """Freeze every parameter that ``train.trainable`` does not train: ``all`` (the paper) trains
    everything, ``attention`` the attention blocks only, located by the family's adapter. Returns
    (trainable, total) parameter counts.

    Raises:
        GqakitError: the family has no adapter (for ``attention``), or nothing matched.
    """
    params = dict(model.named_parameters())
    model_type = getattr(model.config, "model_type", "")
    if mode == "attention":
        block = get_adapter(model_type).o.rsplit(".", 1)[0]  # model.layers.{layer}.self_attn
        regex = re.compile(re.escape(block).replace(r"\{layer\}", r"\d+") + r"\.")
        for name, p in params.items():
            p.requires_grad_(bool(regex.match(name)))
    chosen = sum(p.numel() for p in params.values() if p.requires_grad)
    if chosen == 0:
        raise GqakitError(
            f"train.trainable={mode} matched no parameter of this {model_type} model (first names: "
            f"{', '.join(list(params)[:3])}). Use train.trainable=all."
        )
    return chosen, sum(p.numel() for p in params.values())


def load_teacher(recipe: Recipe, acc: Any, speed: SpeedConfig) -> Any:
    """The frozen teacher of ``distill`` / ``mix`` in the run's precision, in eval mode, on its device;
    None for ``lm``. Under FSDP it is sharded like the student (:func:`shard`; no optimizer, no
    gradients), so each process holds 1/N of it instead of a whole copy."""
    r = recipe
    if r.objective.kind == "lm":
        if r.teacher:
            log.warning("teacher %s is not used: objective.kind is lm", r.teacher)
        return None
    sharded = distributed_kind(acc) == "FSDP"
    device = "cpu" if sharded else str(acc.device)  # fully_shard moves each process's shard to its device
    teacher = load_causal_lm(r.teacher, dtype=dtype_name(r.train.precision), device=device)
    teacher.requires_grad_(False)
    teacher.eval()
    speed_up(teacher, speed)
    if sharded:
        shard(teacher, acc)
        here = sum(p.to_local().numel() for p in teacher.parameters())
        log.info(
            "teacher %s sharded over %d processes (fully_shard): %s of its %s parameters in each",
            r.teacher, acc.num_processes, f"{here:,}", f"{teacher.num_parameters():,}",
        )  # fmt: skip
    why = fused_loss_unsupported(teacher) if speed.fused_loss else None
    if sharded and speed.fused_loss:
        why = "a sharded teacher's output projection is whole only inside its forward"
    if why:
        raise GqakitError(
            f"speed.fused_loss cannot use the teacher {r.teacher}: {why}. Set speed.fused_loss=false."
        )
    return teacher


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


# --- Speed levers: each recipe option under ``speed:``, ``auto`` resolved per device (docs/uptrain.md#speed)


def resolve_speed(
    cfg: SpeedConfig, device_type: str, distributed_type: str, model: torch.nn.Module
) -> tuple[SpeedConfig, str]:
    """The levers this run uses (no ``auto`` left) and the log line saying what runs and what is off.
    ``auto`` is what was measured fastest per device (the table in docs/uptrain.md#speed: eager on a GPU,
    the fused loss's chunk loop costs more than it saves); a lever the device cannot run is turned off."""
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
    speed = SpeedConfig(fused_loss=fused and not reason, compile=compile_, device=cfg.device)
    on = [n for n, v in (("fused loss", speed.fused_loss), ("compile", compile_)) if v]
    said = "speed: " + (", ".join(on) if on else "plain eager loop")
    return speed, said + ("; off: " + "; ".join(off) if off else "")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder blocks: modules of the classes transformers will not split."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def speed_up(model: torch.nn.Module, speed: SpeedConfig) -> None:
    """``torch.compile`` of each decoder layer in place (one compiled graph serves every layer; parameter
    names and checkpoints are unchanged)."""
    if speed.compile:
        for layer in decoder_layers(model):
            layer.compile()
