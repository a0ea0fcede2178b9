"""The uptraining run, top to bottom: ``uptrain(recipe)`` checks, sets up, trains and saves
(docs/uptrain.md#the-loop). One process or many (DDP, FSDP2, several nodes) is decided by ``accelerate
launch`` and its config, never here; every process runs all of it, and only the main process writes
shared files."""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from gqakit import __version__
from gqakit.checkpoint import copy_non_weight_files, model_source
from gqakit.console import progress as progress_bar
from gqakit.console import quiet_transformers
from gqakit.convert import convert_checkpoint
from gqakit.storage import write_json, write_text
from gqakit.uptrain.checkpoints import (
    CHECKPOINTS,
    CONVERTED,
    METRICS,
    PROVENANCE,
    log_eval,
    log_train,
    resume_run,
    rollback,
    save_checkpoint,
    whole_state_dict,
)
from gqakit.uptrain.objectives import hidden_and_head, lm_loss_per_sequence
from gqakit.uptrain.preflight import preflight, process_state
from gqakit.uptrain.recipe import expand
from gqakit.uptrain.recipe_schema import ObjectiveConfig, Recipe
from gqakit.uptrain.schedule import lr_multiplier, warmup_steps
from gqakit.uptrain.setup import Run, distributed_kind, run_dir, setup

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
    if not (recipe.log.all_ranks or process_state().is_main_process):  # one log per run, unless log.all_ranks
        logging.getLogger("gqakit").setLevel(logging.ERROR)  # the other processes: errors only, no bars
        quiet_transformers()
    # preflight: everything, before anything is written
    with run_dir(out, resume, force, lambda: preflight(recipe, resume=resume, force=force)):
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
        if bool(torch.isfinite(stats).all()) and math.isfinite(float(grad_norm)):
            run.optimizer.step()
            bad_streak = 0
        else:
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
        due = (r.eval.every and s.step % r.eval.every == 0) or s.step in r.eval.at_steps
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
                teacher = hidden_and_head(run.teacher, ids)
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


def finish(run: Run, conversion: dict[str, Any], start: float) -> UptrainResult:
    """Evaluate the final model and write it at the run directory's root (safetensors, config, tokenizer),
    its provenance ``gqakit.json`` last (atomically): its presence marks a finished run. Under FSDP the
    whole tensors are gathered to the main process, which alone writes."""
    r, b, s, acc = run.recipe, run.budget, run.state, run.acc
    val_loss, val_ppl = evaluate(acc, run.model, run.val_loader)
    log_eval(run, val_loss, val_ppl)
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
        "distributed_type": distributed_kind(acc),
        "precision": r.train.precision,
        "skipped_steps": s.skipped,
        "rollbacks": s.rollbacks,
        "elapsed_s": round(time.perf_counter() - start, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "recipe": r.to_dict(),
    }
    acc.wait_for_everyone()
    state_dict = whole_state_dict(acc, run.model)
    if acc.is_main_process:
        model = acc.unwrap_model(run.model)
        state_dict = {k: v.to(run.save_dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        model.config.use_cache = True
        model.save_pretrained(run.out, state_dict=state_dict, safe_serialization=True)
        # save_pretrained records the dtype of the float32 master weights; the file holds save_dtype,
        # which from_pretrained(dtype="auto") must read back.
        model.config.dtype = run.save_dtype
        model.config.save_pretrained(run.out)
        copy_non_weight_files(Path(run.model_path), run.out)
        run.tokenizer.save_pretrained(run.out)
        write_json(run.out / PROVENANCE, provenance)
        if not r.checkpoint.keep_after_finish:
            shutil.rmtree(run.out / CHECKPOINTS, ignore_errors=True)
    acc.wait_for_everyone()
    acc.end_training()
    same = {f.name for f in fields(UptrainResult)} & provenance.keys()  # steps, tokens, alpha...
    return UptrainResult(output_dir=run.out, history=run.out / METRICS, **{k: provenance[k] for k in same})


def validation_perplexity(recipe: Recipe, model_path: str) -> tuple[float, int]:
    """``model_path``'s perplexity on ``recipe``'s validation blocks, measured exactly as a run measures
    its evaluations (same blocks, precision, batch and reduction): the reference a run's evaluations are
    read against, e.g. the original model of a recovery curve. One process.

    Returns:
        The perplexity and the number of validation blocks.
    """
    lm_only = replace(recipe, teacher=None, objective=ObjectiveConfig())  # no teacher: only evaluated
    run = setup(lm_only, Path(expand(recipe.output_dir)), model_path)
    ppl = evaluate(run.acc, run.model, run.val_loader)[1]
    run.acc.end_training()
    return ppl, len(run.blocks.val)
