"""The uptraining loop: accelerate ``prepare`` / ``accumulate`` / ``backward``, nothing hand-written.

One process or many (DDP, FSDP2, DeepSpeed, several nodes) is decided by ``accelerate launch`` and its
config file, never here. :class:`UptrainLoop` sets everything up in named helpers, then
:meth:`UptrainLoop.train` runs the budget::

    setup: accelerator -> student (frozen as asked) -> teacher -> data -> optimizer + schedule -> prepare
    each step: grad_accum micro-batches (forward, loss, backward) -> clip -> finite? step : skip
               -> log -> eval every N -> checkpoint every N
    end:   final validation -> gathered full state dict -> HF safetensors + tokenizer + gqakit.json

A non-finite loss or gradient norm skips the step (no update); ``guard.max_bad_steps`` in a row roll the
run back to the last checkpoint and continue with the learning rate times ``guard.lr_factor``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gqakit import __version__
from gqakit.checkpoint import copy_non_weight_files, write_json
from gqakit.errors import GqakitError
from gqakit.uptrain.data import build_blocks
from gqakit.uptrain.objectives import Objective, lm_loss_per_sequence
from gqakit.uptrain.recipe import Recipe
from gqakit.uptrain.schedule import Budget, lr_multiplier, resolve_budget
from gqakit.uptrain.trainable import apply_trainable

log = logging.getLogger("gqakit.uptrain")

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
PROVENANCE = "gqakit.json"
_MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}
_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SAVE_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


class TrainState:
    """Counters saved in every checkpoint (through ``accelerator.register_for_checkpointing``).

    ``batches_seen`` is the data position: micro-batches this process has drawn, across epochs. It is
    not rolled back with the weights, so a rollback goes on with fresh data.
    """

    def __init__(self) -> None:
        self.step = 0
        self.batches_seen = 0
        self.lr_scale = 1.0
        self.rollbacks = 0
        self.skipped = 0
        self.initial_val_ppl: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (main process only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run writes them again)."""
        if self.enabled and self.path.is_file():
            keep = [
                ln
                for ln in self.path.read_text().splitlines()
                if ln and json.loads(ln).get("step", 0) <= step
            ]
            self.path.write_text("".join(ln + "\n" for ln in keep))


def read_history(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``: training steps (``loss``...), evaluations (``val_ppl``)."""
    path = Path(output_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint directory (``checkpoints/step-00000100``), or None."""
    found = sorted((Path(output_dir) / CHECKPOINTS).glob("step-*"))
    return found[-1] if found else None


class UptrainLoop:
    """One uptraining run: ``UptrainLoop(recipe, output_dir, model_path).run(resume)``.

    Args:
        recipe: the validated recipe.
        output_dir: the run directory (already checked and created by :func:`gqakit.uptrain.api.uptrain`).
        model_path: the checkpoint to train (the converted one when the recipe converts).
    """

    def __init__(self, recipe: Recipe, output_dir: Path, model_path: str) -> None:
        self.recipe = recipe
        self.out = Path(output_dir)
        self.model_path = model_path
        self.state = TrainState()
        self.objective = Objective(
            recipe.objective.kind, recipe.objective.temperature, recipe.objective.distill_weight
        )

    # ------------------------------------------------------------------ setup
    def _setup_accelerator(self) -> None:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration

        r = self.recipe
        # The accelerator state is a process-wide singleton that refuses a second, different precision,
        # and one process may run several recipes (a notebook, the demo, tests): start it afresh. The
        # process group (PartialState) is kept.
        AcceleratorState._reset_state(reset_partial_state=False)
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
        except ValueError as e:  # e.g. fp16 without a GPU
            raise GqakitError(f"train.precision={r.train.precision} cannot run here: {e}") from None
        from accelerate.utils import set_seed

        set_seed(r.seed)
        self.metrics = MetricsLog(self.out / METRICS, self.acc.is_main_process)

    def _setup_model(self) -> None:
        from transformers import AutoModelForCausalLM

        r = self.recipe
        try:
            # float32 master weights; bf16/fp16 are autocast by accelerate.
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise GqakitError(f"Could not load the model {self.model_path}: {e}") from None
        self.save_dtype = (
            _SAVE_DTYPE[r.model.save_dtype]
            if r.model.save_dtype != "auto"
            else _SAVE_DTYPE.get(
                str(getattr(model.config, "dtype", "float32")).replace("torch.", ""), torch.float32
            )
        )
        self.n_trainable, self.n_params = apply_trainable(model, r.train.trainable)
        if r.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
        self.model = model

    def _setup_teacher(self) -> None:
        from accelerate.utils import DistributedType

        from gqakit.models import load_causal_lm

        r = self.recipe
        self.teacher = None
        if not self.objective.needs_teacher:
            if r.teacher:
                log.warning("teacher %s is not used: objective.kind is lm", r.teacher)
            return
        if self.acc.distributed_type == DistributedType.DEEPSPEED:
            raise GqakitError(
                "objective.kind=distill/mix is not supported under DeepSpeed (ZeRO-3 would partition the "
                "teacher too). Use recipes/accelerate/fsdp.yaml or ddp.yaml, or objective.kind=lm."
            )
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[r.train.precision]
        self.teacher = load_causal_lm(r.teacher, dtype=dtype, device=str(self.acc.device))
        self.teacher.requires_grad_(False)

    def _setup_data(self) -> None:
        from torch.utils.data import DataLoader

        from gqakit.models import load_tokenizer

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
        self.warmup = int(r.train.warmup_fraction * self.budget.steps)

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
        # per process, so it stays unwrapped and is only registered for checkpointing.
        acc.register_for_checkpointing(self.scheduler, self.state)

    def _setup_trackers(self) -> None:
        if self.acc.log_with:
            flat = _flatten(self.recipe.to_dict())
            self.acc.init_trackers("uptrain", config=flat)

    # ------------------------------------------------------------------ one step
    def _loss_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids = batch["input_ids"]
        logits = self.model(input_ids=ids, use_cache=False).logits
        teacher_logits = None
        if self.teacher is not None:
            with torch.no_grad(), self.acc.autocast():
                teacher_logits = self.teacher(input_ids=ids, use_cache=False).logits
        return self.objective(logits, ids, teacher_logits)

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches forever, epoch after epoch, starting at the saved data position."""
        per_epoch = len(self.train_loader)
        epoch, skip = divmod(self.state.batches_seen, per_epoch)
        while True:
            self.train_loader.set_epoch(epoch)
            loader = self.acc.skip_first_batches(self.train_loader, skip) if skip else self.train_loader
            for batch in loader:
                self.state.batches_seen += 1
                yield batch
            epoch, skip = epoch + 1, 0

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Mean validation loss and perplexity over every validation block, all processes together."""
        self.model.eval()
        losses = []
        for batch in self.val_loader:
            logits = self.model(input_ids=batch["input_ids"], use_cache=False).logits
            losses.append(self.acc.gather_for_metrics(lm_loss_per_sequence(logits, batch["input_ids"])))
        self.model.train()
        loss = torch.cat(losses).mean().item()
        return loss, math.exp(min(loss, 700.0))

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self) -> None:
        acc, step = self.acc, self.state.step
        root = self.out / CHECKPOINTS
        final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.partial"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            write_json(
                tmp / "trainer_state.json", {**self.state.state_dict(), "tokens": self.budget.tokens(step)}
            )
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in sorted(root.glob("step-*"))[: -self.recipe.checkpoint.keep or None]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def _load_checkpoint(self, path: Path) -> None:
        self.acc.load_state(str(path))
        self._apply_lr()

    def _apply_lr(self) -> None:
        """Put the current step's learning rate into the optimizer (the schedule's lambda reads lr_scale)."""
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * self._lr_lambda(self.scheduler.last_epoch)

    def resume(self) -> bool:
        """Restore the newest checkpoint (model, optimizer, schedule, RNG, data position); False if none."""
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            log.info("no checkpoint in %s yet: starting from the beginning", self.out / CHECKPOINTS)
            return False
        self._load_checkpoint(ckpt)
        self.metrics.truncate_after(self.state.step)
        log.info("resumed from %s: %s", ckpt, self.budget.progress(self.state.step))
        return True

    def _rollback(self) -> None:
        g, s = self.recipe.guard, self.state
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            raise GqakitError(
                f"{g.max_bad_steps} non-finite steps in a row at step {s.step} and no checkpoint to roll "
                f"back to. Lower train.lr (now {self.recipe.train.lr:g}), or set checkpoint.every so the "
                "guard can roll back."
            )
        if s.rollbacks >= g.max_rollbacks:
            raise GqakitError(
                f"Still non-finite after {s.rollbacks} rollback(s) (learning rate x{s.lr_scale:g}) at step "
                f"{s.step}. Lower train.lr, raise train.warmup_fraction, or use train.precision=fp32/bf16."
            )
        # Weights, optimizer, schedule and RNG come back from the checkpoint; the data position and the
        # counters go on, and the learning rate drops.
        seen, scale, rollbacks, skipped = s.batches_seen, s.lr_scale, s.rollbacks, s.skipped
        self.acc.load_state(str(ckpt))
        s.batches_seen, s.lr_scale, s.rollbacks, s.skipped = seen, scale * g.lr_factor, rollbacks + 1, skipped
        self._apply_lr()
        log.warning("rolled back to %s; learning rate now x%g", ckpt.name, s.lr_scale)
        self.metrics.write(
            {"step": s.step, "event": "rollback", "checkpoint": ckpt.name, "lr_scale": s.lr_scale}
        )

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        r, acc, s = self.recipe, self.acc, self.state
        from tqdm.auto import tqdm

        if r.eval.at_start and s.step == 0 and s.initial_val_ppl is None:
            loss, s.initial_val_ppl = self.evaluate()
            self._log_eval(loss, s.initial_val_ppl)
        batches = self._batches()
        bar = tqdm(
            total=self.budget.steps,
            initial=s.step,
            desc="uptrain",
            unit="step",
            disable=not (acc.is_local_main_process and r.log.progress),
            dynamic_ncols=True,
        )
        max_norm = r.train.max_grad_norm or float("inf")
        bad_streak = 0
        start, start_step = time.perf_counter(), s.step
        while s.step < self.budget.steps:
            t0 = time.perf_counter()
            # Loss, lm, kl summed over micro-batches, then averaged over micro-batches and processes.
            sums = torch.zeros(3, device=acc.device)
            for _ in range(r.train.grad_accum):
                batch = next(batches)
                with acc.accumulate(self.model):
                    loss, parts = self._loss_step(batch)
                    acc.backward(loss)
                zero = sums.new_zeros(())
                sums += torch.stack([loss.detach().float(), parts.get("lm", zero), parts.get("kl", zero)])
            grad_norm = acc.clip_grad_norm_(self.model.parameters(), max_norm)
            stats = acc.reduce(sums / r.train.grad_accum, reduction="mean")
            # fp16's grad scaler skips an overflowing step by itself; only the loss counts then.
            # (DeepSpeed clips inside its engine and may report the norm as a float, or not at all.)
            norm_ok = grad_norm is None or r.train.precision == "fp16" or math.isfinite(float(grad_norm))
            lr = self.optimizer.param_groups[0]["lr"]  # this step's learning rate
            if bool(torch.isfinite(stats).all()) and norm_ok:
                self.optimizer.step()
                bad_streak = 0
            else:
                bad_streak += 1
                s.skipped += 1
                log.warning(
                    "step %d: non-finite loss or gradient norm, skipped (%d in a row)", s.step, bad_streak
                )
            self.optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # a skipped step did not call optimizer.step(); that is intended
                warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
                self.scheduler.step()
            s.step += 1
            if bad_streak >= r.guard.max_bad_steps:
                self._rollback()
                bad_streak = 0
                bar.n = s.step
                continue

            dt = time.perf_counter() - t0
            tok_s = self.budget.tokens_per_step / dt
            bar.update(1)
            bar.set_postfix(
                loss=f"{stats[0].item():.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False
            )
            if s.step % r.log.every == 0 or s.step == self.budget.steps:
                self._log_train(stats, grad_norm, lr, tok_s, s.step - start_step, time.perf_counter() - start)
            if r.eval.every and s.step % r.eval.every == 0 and s.step < self.budget.steps:
                self._log_eval(*self.evaluate())
            if r.checkpoint.every and s.step % r.checkpoint.every == 0 and s.step < self.budget.steps:
                self._save_checkpoint()
        bar.close()

    def _log_train(
        self, stats: torch.Tensor, grad_norm: Any, lr: float, tok_s: float, steps_here: int, elapsed: float
    ) -> None:
        s, b = self.state, self.budget
        record: dict[str, Any] = {"step": s.step, "tokens": b.tokens(s.step), "alpha": b.alpha(s.step)}
        record["loss"] = stats[0].item()
        if "lm" in self._parts():
            record["lm"] = stats[1].item()
        if "kl" in self._parts():
            record["kl"] = stats[2].item()
        record.update(
            lr=lr,
            grad_norm=None if grad_norm is None else float(grad_norm),
            tokens_per_s=tok_s,
            avg_tokens_per_s=steps_here * b.tokens_per_step / max(elapsed, 1e-9),
        )
        self.metrics.write(record)
        self.acc.log({f"train/{k}": v for k, v in record.items() if isinstance(v, float | int)}, step=s.step)

    def _parts(self) -> tuple[str, ...]:
        return {"lm": ("lm",), "distill": ("kl",), "mix": ("lm", "kl")}[self.objective.kind]

    def _log_eval(self, loss: float, ppl: float) -> None:
        s, b = self.state, self.budget
        self.metrics.write(
            {
                "step": s.step,
                "tokens": b.tokens(s.step),
                "alpha": b.alpha(s.step),
                "val_loss": loss,
                "val_ppl": ppl,
            }
        )
        self.acc.log({"val/loss": loss, "val/ppl": ppl}, step=s.step)
        log.info("%s: validation loss %.4f, perplexity %.3f", b.progress(s.step), loss, ppl)

    # ------------------------------------------------------------------ the result
    def save_final(self, provenance: dict[str, Any]) -> None:
        """Write the final model at the run directory's root: safetensors, config, tokenizer, gqakit.json.

        Under FSDP and DeepSpeed the full state dict is gathered by ``accelerator.get_state_dict``; only
        the main process writes. Files go to a temporary directory first and are moved into place with
        ``gqakit.json`` last, whose presence marks a finished run.
        """
        acc = self.acc
        acc.wait_for_everyone()
        state_dict = acc.get_state_dict(self.model)
        if acc.is_main_process:
            model = acc.unwrap_model(self.model)
            tmp = self.out / ".final.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            state_dict = {
                k: v.to(self.save_dtype) if v.is_floating_point() else v for k, v in state_dict.items()
            }
            model.config.use_cache = True
            model.config.dtype = self.save_dtype
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            copy_non_weight_files(Path(self.model_path), tmp)
            self.tokenizer.save_pretrained(tmp)
            write_json(tmp / PROVENANCE, provenance)
            for item in sorted(tmp.iterdir(), key=lambda p: p.name == PROVENANCE):
                os.replace(item, self.out / item.name)
            tmp.rmdir()
            if not self.recipe.checkpoint.keep_after_finish:
                shutil.rmtree(self.out / CHECKPOINTS, ignore_errors=True)
        acc.wait_for_everyone()

    def run(self, resume: bool = False, extra_provenance: dict[str, Any] | None = None) -> UptrainResult:
        """Set up, (resume,) train the budget, evaluate, save; return the result."""
        start = time.perf_counter()
        self._setup_accelerator()
        self._setup_model()
        self._setup_teacher()
        self._setup_data()
        self._setup_optimizer()
        self._prepare()
        self._setup_trackers()
        r, b = self.recipe, self.budget
        log.info(
            "uptrain %s: %s trainable of %s parameters (%s); %s processes (%s), precision %s",
            self.model_path,
            f"{self.n_trainable:,}",
            f"{self.n_params:,}",
            r.train.trainable,
            self.acc.num_processes,
            self.acc.distributed_type.value,
            r.train.precision,
        )
        log.info(
            "data: %d train / %d validation blocks of %d tokens from %s",
            len(self.blocks.train),
            len(self.blocks.val),
            r.data.seq_len,
            self.blocks.source,
        )
        log.info("budget: %s; %s tokens per step", b.describe(), f"{b.tokens_per_step:,}")
        if resume:
            self.resume()
        self.train()
        val_loss, val_ppl = self.evaluate()
        self._log_eval(val_loss, val_ppl)
        s = self.state
        elapsed = time.perf_counter() - start
        provenance = {
            "tool": "gqakit",
            "version": __version__,
            "command": "uptrain",
            "model": r.model.path,
            "trained": self.model_path,
            **(extra_provenance or {}),
            "teacher": r.teacher if self.objective.needs_teacher else None,
            "objective": r.objective.kind,
            "trainable": r.train.trainable,
            "steps": s.step,
            "tokens": b.tokens(s.step),
            "alpha": b.alpha(s.step),
            "pretraining_tokens": b.pretraining_tokens,
            "initial_val_ppl": s.initial_val_ppl,
            "final_val_ppl": val_ppl,
            "final_val_loss": val_loss,
            "val_blocks": len(self.blocks.val),
            "data": self.blocks.source,
            "processes": self.acc.num_processes,
            "distributed_type": self.acc.distributed_type.value,
            "precision": r.train.precision,
            "skipped_steps": s.skipped,
            "rollbacks": s.rollbacks,
            "elapsed_s": round(elapsed, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "recipe": r.to_dict(),
        }
        self.save_final(provenance)
        self.acc.end_training()
        return UptrainResult(
            output_dir=self.out,
            steps=s.step,
            tokens=b.tokens(s.step),
            alpha=b.alpha(s.step),
            final_val_ppl=val_ppl,
            elapsed_s=elapsed,
            history=self.out / METRICS,
            initial_val_ppl=s.initial_val_ppl,
            skipped_steps=s.skipped,
            rollbacks=s.rollbacks,
        )


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested recipe -> ``{"train.lr": 1e-4, ...}`` with only scalar values (what TensorBoard accepts)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, int | float | str | bool) else str(v)
    return out


__all__ = [
    "CHECKPOINTS",
    "METRICS",
    "PROVENANCE",
    "TrainState",
    "UptrainLoop",
    "UptrainResult",
    "latest_checkpoint",
    "read_history",
]
