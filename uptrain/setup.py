"""The uptraining loop's named setup helpers: accelerator, student, teacher, data, optimizer, prepare."""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch.utils.data import DataLoader

from gqakit.errors import GqakitError
from gqakit.models import load_causal_lm, load_tokenizer
from gqakit.uptrain.data import build_blocks
from gqakit.uptrain.fused_loss import LossSpec
from gqakit.uptrain.metrics import METRICS, MetricsLog
from gqakit.uptrain.preflight import environment_problems, process_state
from gqakit.uptrain.schedule import Budget, lr_multiplier, resolve_budget, warmup_steps
from gqakit.uptrain.speed import (
    apply_kernels,
    compile_layers,
    fused_loss_unsupported,
    install_fused_loss,
    resolve_speed,
)
from gqakit.uptrain.trainable import apply_trainable

log = logging.getLogger("gqakit.uptrain")

_MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}
_SAVE_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def checkpoint_dtype(path: str) -> torch.dtype:
    """The dtype a checkpoint's ``config.json`` states (what ``model.save_dtype: auto`` saves in).

    Args:
        path: a checkpoint directory or hub id (the converted checkpoint when the recipe converts first;
            conversion keeps the source's dtype).

    Returns:
        The stated float32, bfloat16 or float16; float32 when the config states none or another.
    """
    # deferred: transformers takes seconds to import
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return torch.float32
    stated = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)  # older transformers
    return _SAVE_DTYPE.get(str(stated).replace("torch.", ""), torch.float32)


class SetupMixin:
    """``_setup_*`` and ``_prepare``: everything the loop needs before its first step."""

    def _setup_accelerator(self) -> None:
        # deferred: accelerate takes seconds to import
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration

        r = self.recipe
        # The accelerator state is a process-wide singleton that refuses a second, different precision,
        # and one process may run several recipes (a notebook, the demo, tests): start it afresh. The
        # process group (PartialState) is kept.
        AcceleratorState._reset_state(reset_partial_state=False)
        process_state(r.speed.device)  # a single process on the recipe's device (auto: accelerate's)
        tensorboard = r.log.tensorboard and (
            importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        )
        try:
            self.acc = Accelerator(
                mixed_precision=_MIXED[r.train.precision],
                # Exactly grad_accum micro-batches per step, also across an epoch boundary.
                gradient_accumulation_plugin=GradientAccumulationPlugin(
                    num_steps=r.train.grad_accum, sync_with_dataloader=False, adjust_scheduler=False
                ),
                # The data order depends on the seed and the epoch only, so a resumed run sees the same.
                dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=r.seed),
                log_with=["tensorboard"] if tensorboard else None,
                project_config=ProjectConfiguration(
                    project_dir=str(self.out), logging_dir=str(self.out / "tb")
                ),
                step_scheduler_with_optimizer=False,
            )
        except ValueError as e:  # e.g. bf16 on a GPU without it
            raise GqakitError(f"train.precision={r.train.precision} cannot run here: {e}") from None
        # Checked before any work (gqakit.uptrain.preflight); again here for callers of UptrainLoop.
        problems = environment_problems(r, self.acc.distributed_type.value, self.acc.device.type)
        if problems:
            raise GqakitError(" ".join(problems))
        self.precision = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}.get(
            str(self.acc.mixed_precision), str(self.acc.mixed_precision)
        )  # what runs, recorded in gqakit.json and the log
        # deferred: accelerate takes seconds to import
        from accelerate.utils import set_seed

        set_seed(r.seed)
        self.metrics = MetricsLog(self.out / METRICS, self.acc.is_main_process)

    def _setup_model(self) -> None:
        # deferred: transformers takes seconds to import
        from transformers import AutoModelForCausalLM

        r = self.recipe
        try:
            # float32 master weights; bf16/fp16 are autocast by accelerate.
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise GqakitError(f"Could not load the model {self.model_path}: {e}") from None
        # Not model.config.dtype: loading in float32 above has overwritten it with float32.
        self.save_dtype = (
            _SAVE_DTYPE[r.model.save_dtype]
            if r.model.save_dtype != "auto"
            else checkpoint_dtype(self.model_path)
        )
        self.n_trainable, self.n_params = apply_trainable(model, r.train.trainable)
        if r.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
        self.speed = resolve_speed(r.speed, self.acc.device.type, self.acc.distributed_type.value, model)
        log.info(self.speed.describe())
        self._speed_up(model)
        if self.speed.fused_loss:
            install_fused_loss(model)
        self.loss_spec = LossSpec(
            r.objective.kind,
            r.objective.temperature,
            r.objective.distill_weight,
            compute_dtype=_AUTOCAST_DTYPE.get(r.train.precision),
        )
        self.model = model

    def _speed_up(self, model: torch.nn.Module) -> None:
        """Liger's kernels and per-layer ``torch.compile``, as resolved (student and teacher alike)."""
        apply_kernels(model, self.speed.kernels)
        if self.speed.compile:
            compile_layers(model)

    def _setup_teacher(self) -> None:

        r = self.recipe
        self.teacher = None
        if not self.objective.needs_teacher:
            if r.teacher:
                log.warning("teacher %s is not used: objective.kind is lm", r.teacher)
            return
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[r.train.precision]
        self.teacher = load_causal_lm(r.teacher, dtype=dtype, device=str(self.acc.device))
        self.teacher.requires_grad_(False)
        self._speed_up(self.teacher)
        why = fused_loss_unsupported(self.teacher) if self.speed.fused_loss else None
        if why:
            raise GqakitError(
                f"speed.fused_loss cannot use the teacher {r.teacher}: {why}. Set speed.fused_loss=false."
            )

    def _setup_data(self) -> None:

        r = self.recipe
        self.tokenizer = load_tokenizer(self.model_path)
        with self.acc.main_process_first():
            self.blocks = build_blocks(r.data, self.tokenizer, r.seed)
        world = self.acc.num_processes
        if len(self.blocks.train) < r.train.batch_size * world:
            raise GqakitError(
                f"The training text gives {len(self.blocks.train)} block(s) of {r.data.seq_len} tokens, "
                f"fewer than one batch (train.batch_size={r.train.batch_size} x {world} process(es)). Add "
                "text, or lower data.seq_len or train.batch_size."
            )
        self.train_loader = DataLoader(
            self.blocks.train, batch_size=r.train.batch_size, shuffle=True, drop_last=True
        )
        self.val_loader = DataLoader(self.blocks.val, batch_size=r.eval.batch_size or r.train.batch_size)
        self.budget: Budget = resolve_budget(
            r.budget, r.train.batch_size * r.train.grad_accum * world * r.data.seq_len
        )
        self.warmup = warmup_steps(r.train.warmup_fraction, self.budget.steps)

    def _setup_optimizer(self) -> None:
        t = self.recipe.train
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": t.weight_decay},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        try:  # the fused kernel (CPU and GPU) is the fastest AdamW, and what HF Trainer uses by default
            self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, fused=True)
        except (RuntimeError, ValueError):
            self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)

    def _lr_lambda(self, step: int) -> float:
        t = self.recipe.train
        return lr_multiplier(step, self.budget.steps, self.warmup, t.min_lr_ratio) * self.state.lr_scale

    def _prepare(self) -> None:
        acc = self.acc
        self.model, self.optimizer, self.train_loader, self.val_loader = acc.prepare(
            self.model, self.optimizer, self.train_loader, self.val_loader
        )
        # The schedule counts global optimizer steps; accelerate's scheduler wrapper would step it once
        # per process, so it stays unwrapped. Nothing is registered with accelerate for checkpointing:
        # gqakit writes and reads its checkpoints itself (gqakit.uptrain.state_io).
