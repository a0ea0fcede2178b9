"""The rules of a recipe that involve more than one field, each problem reported with the others."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gqakit.cli_options import Problems, device_problem, rate_problem

if TYPE_CHECKING:
    from gqakit.uptrain.recipe_schema import Recipe


def recipe_problems(self: Recipe) -> list[str]:
    """Every rule of ``self`` that involves more than one field's type; empty when the recipe is valid."""
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
    if self.model.convert is not None:  # convert's own rules, its fields named as the recipe names them
        convert = Problems("convert", names=lambda f: f"model.convert.{f}")
        self.model.convert.options().check(convert, paths=False)
        p += convert.messages
    if not self.output_dir:
        p.append("output_dir is empty.")
    if bool(d.files) == bool(d.hub):
        p.append("data: give either data.files (local files) or data.hub (a hub dataset), not both.")
    if d.val_files and d.hub:
        p.append("data.val_files goes with data.files; with data.hub use data.val_split.")
    if d.val_split and d.files and not d.hub:  # build_blocks would ignore it, holding out val_fraction
        p.append(
            f"data.val_split={d.val_split!r} only applies to data.hub; with data.files set "
            "data.val_split=null and give data.val_files (or hold out data.val_fraction)."
        )
    if d.seq_len < 2:
        p.append(f"data.seq_len must be at least 2, got {d.seq_len}.")
    if not d.val_files and not (d.hub and d.val_split) and not 0 < d.val_fraction < 1:
        p.append(f"data.val_fraction must be between 0 and 1 (exclusive), got {d.val_fraction}.")
    if d.max_val_blocks is not None and d.max_val_blocks < 1:
        p.append(f"data.max_val_blocks must be at least 1 (or null), got {d.max_val_blocks}.")
    # YAML reads .inf and .nan: such a run fails steps into it (type(t).lr: the field's default)
    lr = rate_problem("train.lr", t.lr, type(t).lr)
    if lr:
        p.append(lr)
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
        p.append(f"train.max_grad_norm must be positive (or null for no clipping), got {t.max_grad_norm}.")
    if o.kind in ("distill", "mix") and not self.teacher:
        p.append(f"objective.kind {o.kind!r} needs a teacher: set teacher to the original checkpoint.")
    if o.temperature <= 0:
        p.append(f"objective.temperature must be positive, got {o.temperature}.")
    if not 0 <= o.distill_weight <= 1:
        p.append(f"objective.distill_weight must be in [0, 1], got {o.distill_weight}.")
    for section, k in (("eval", "every"), ("checkpoint", "every")):
        if getattr(getattr(self, section), k) < 0:
            p.append(f"{section}.{k} must be >= 0, got {getattr(getattr(self, section), k)}.")
    if self.checkpoint.keep < 1:  # 0 would delete each checkpoint as it is written: no resume, no rollback
        p.append(
            f"checkpoint.keep must be at least 1, got {self.checkpoint.keep}: --resume and the non-finite "
            "guard's rollback need the newest checkpoint. To write none, set checkpoint.every=0."
        )
    bad_steps = [n for n in self.eval.at_steps if n < 1]
    if bad_steps:
        p.append(f"eval.at_steps must hold steps of at least 1, got {bad_steps}.")
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
    device = device_problem(self.speed.device, "speed.device")
    if device:
        p.append(device)
    return p
