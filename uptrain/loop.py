"""The uptraining loop: accelerate ``prepare`` / ``accumulate`` / ``backward``, nothing hand-written.

One process or many (DDP, FSDP2, DeepSpeed, several nodes) is decided by ``accelerate launch`` and its
config file, never here. :class:`UptrainLoop` sets everything up in named helpers
(:mod:`gqakit.uptrain.setup`), then :meth:`UptrainLoop.train` runs the budget; checkpoints and resuming
are in :mod:`gqakit.uptrain.run_checkpoints`, the records in :mod:`gqakit.uptrain.metrics`::

    setup: accelerator -> student (frozen as asked) -> teacher -> data -> optimizer + schedule -> prepare
    each step: grad_accum micro-batches (forward, loss, backward) -> clip -> finite? step : skip
               -> log -> eval every N -> checkpoint every N
    end:   final validation -> gathered full state dict -> HF safetensors + tokenizer + gqakit.json

A non-finite loss or gradient norm skips the step (no update); ``guard.max_bad_steps`` in a row roll the
run back to the last checkpoint and continue with the learning rate times ``guard.lr_factor``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gqakit import __version__
from gqakit.checkpoint import copy_non_weight_files
from gqakit.files import write_json
from gqakit.uptrain.metrics import METRICS, MetricsMixin, read_history
from gqakit.uptrain.objectives import Objective, lm_loss_per_sequence
from gqakit.uptrain.preflight import PROVENANCE, resolve_precision
from gqakit.uptrain.recipe import Recipe
from gqakit.uptrain.run_checkpoints import CHECKPOINTS, CheckpointMixin, TrainState, latest_checkpoint
from gqakit.uptrain.setup import SetupMixin
from gqakit.uptrain.speed import attention_backend, teacher_outputs

log = logging.getLogger("gqakit.uptrain")


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


class UptrainLoop(SetupMixin, CheckpointMixin, MetricsMixin):
    """One uptraining run: ``UptrainLoop(recipe, output_dir, model_path).run(resume)``.

    Args:
        recipe: the validated recipe.
        output_dir: the run directory (already checked and created by :func:`gqakit.uptrain.api.uptrain`).
        model_path: the checkpoint to train (the converted one when the recipe converts).
    """

    def __init__(self, recipe: Recipe, output_dir: Path, model_path: str) -> None:
        # ``auto`` becomes what this machine runs, once: every step, evaluation and record then agree
        precision = resolve_precision(recipe.train.precision, recipe.speed.device)
        self.recipe = replace(recipe, train=replace(recipe.train, precision=precision))
        self.out = Path(output_dir)
        self.model_path = model_path
        self.state = TrainState()
        self.objective = Objective(
            recipe.objective.kind, recipe.objective.temperature, recipe.objective.distill_weight
        )

    # ------------------------------------------------------------------ one step
    def _loss_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids = batch["input_ids"]
        with attention_backend(self.speed.attention):
            if self.speed.fused_loss:  # logits never materialised (gqakit.uptrain.fused_loss)
                teacher = None
                if self.teacher is not None:
                    with torch.no_grad(), self.acc.autocast():
                        teacher = teacher_outputs(self.teacher, ids)
                return self.model(input_ids=ids, loss_spec=self.loss_spec, teacher=teacher)
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

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        r, acc, s = self.recipe, self.acc, self.state

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
        eval_at = set(r.eval.at_steps)
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
                # optimizer.step() would have called the fp16 grad scaler's update(); without it the
                # next step's clip_grad_norm_ unscales again and torch raises. update() also lowers the
                # scale when this step's gradients overflowed.
                if acc.scaler is not None:
                    acc.scaler.update()
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
            due = (r.eval.every and s.step % r.eval.every == 0) or s.step in eval_at
            if due and s.step < self.budget.steps:  # the last step is evaluated after the loop
                self._log_eval(*self.evaluate())
            if r.checkpoint.every and s.step % r.checkpoint.every == 0 and s.step < self.budget.steps:
                self._save_checkpoint()
        bar.close()

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
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            # save_pretrained records the dtype of the float32 master weights; the file holds save_dtype,
            # which from_pretrained(dtype="auto") must read back.
            model.config.dtype = self.save_dtype
            model.config.save_pretrained(tmp)
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
            self.precision,
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
            "precision": self.precision,
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


def validation_perplexity(recipe: Recipe, model_path: str) -> tuple[float, int]:
    """``model_path``'s perplexity on ``recipe``'s validation blocks, measured exactly as the loop
    measures its evaluations (same blocks, precision, batch and reduction): the reference a run's
    evaluations are read against, e.g. the original model of a recovery curve. One process.

    Returns:
        The perplexity and the number of validation blocks.
    """
    with tempfile.TemporaryDirectory(prefix="gqakit-val-") as tmp:
        loop = UptrainLoop(recipe, Path(tmp), model_path)
        loop._setup_accelerator()
        loop._setup_model()
        loop._setup_data()
        loop.model, loop.val_loader = loop.acc.prepare(loop.model, loop.val_loader)
        ppl = loop.evaluate()[1]
        loop.acc.end_training()
        return ppl, len(loop.blocks.val)


__all__ = [
    "CHECKPOINTS",
    "METRICS",
    "PROVENANCE",
    "TrainState",
    "UptrainLoop",
    "UptrainResult",
    "latest_checkpoint",
    "read_history",
    "validation_perplexity",
]
