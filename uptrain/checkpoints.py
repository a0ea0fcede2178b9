"""What a run writes in its directory besides the final model: the records (``metrics.jsonl``;
:func:`read_history`) and the resumable checkpoints, with resume and rollback.

Run directories are shared and downloaded, so a resume must not unpickle anything that can carry code,
which accelerate's ``load_state`` does: gqakit writes and reads the pieces itself, as safetensors, JSON
and ``torch.load(weights_only=True)`` (the layout: docs/uptrain.md#the-loop). ``run`` is a
:class:`gqakit.uptrain.setup.Run` throughout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch.distributed.tensor import DTensor

from gqakit.errors import GqakitError
from gqakit.storage import atomic_output_dir, partial_dir, write_text

log = logging.getLogger("gqakit.uptrain")

# The run directory: the final model at its root, with these beside it.
PROVENANCE = "gqakit.json"  # written last: its presence marks a finished run
CHECKPOINTS = "checkpoints"  # checkpoints/step-NNNNNNNN/, renamed into place whole
CONVERTED = Path("work") / "converted"
METRICS = "metrics.jsonl"
STATE_FILE = "trainer_state.json"

# The accelerators whose RNG states a checkpoint keeps besides the CPU's: name -> torch module.
_ACCELERATOR_RNG = {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None)}


@dataclass
class TrainState:
    """The loop's counters, saved in every checkpoint as JSON (``trainer_state.json``).

    ``batches_seen`` is the data position: micro-batches this process has drawn, across epochs. It is
    not rolled back with the weights, so a rollback goes on with fresh data.
    """

    step: int = 0
    batches_seen: int = 0
    lr_scale: float = 1.0
    rollbacks: int = 0
    skipped: int = 0
    initial_val_ppl: float | None = None


# ------------------------------------------------------------ Records: metrics.jsonl (main process), the log


def log_train(
    run: Any, stats: torch.Tensor, grad_norm: Any, lr: float, tok_s: float, steps_here: int, elapsed: float
) -> None:
    s, b, kind = run.state, run.budget, run.recipe.objective.kind
    record = {"step": s.step, "tokens": b.tokens(s.step), "alpha": b.alpha(s.step), "loss": stats[0].item()}
    if kind in ("lm", "mix"):
        record["lm"] = stats[1].item()
    if kind in ("distill", "mix"):
        record["kl"] = stats[2].item()
    record.update(
        lr=lr,
        grad_norm=float(grad_norm),
        tokens_per_s=tok_s,
        avg_tokens_per_s=steps_here * b.tokens_per_step / max(elapsed, 1e-9),
    )
    write_record(run, record)


def log_eval(run: Any, loss: float, ppl: float) -> None:
    s, b = run.state, run.budget
    record = {"step": s.step, "tokens": b.tokens(s.step), "alpha": b.alpha(s.step)}
    write_record(run, {**record, "val_loss": loss, "val_ppl": ppl})
    log.info("%s: validation loss %.4f, perplexity %.3f", b.progress(s.step), loss, ppl)


def write_record(run: Any, record: dict[str, Any]) -> None:
    """Append one JSON line to ``metrics.jsonl`` (main process)."""
    if run.acc.is_main_process:
        with open(run.out / METRICS, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def truncate_records(run: Any, step: int) -> None:
    """Drop the records past ``step`` (a resumed run writes them again), and a line a kill cut short."""
    path = run.out / METRICS
    if run.acc.is_main_process and path.is_file():
        keep = [ln for ln in path.read_text().splitlines() if _record_step(ln) <= step]
        write_text(path, "".join(ln + "\n" for ln in keep))  # atomically: a kill keeps the records whole


def _record_step(line: str) -> float:
    """The step of a record; infinity for a line that is not a whole record."""
    try:
        value = json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf
    return value if isinstance(value, int | float) else math.inf


def read_history(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``: training steps (``loss``...), evaluations (``val_ppl``)."""
    path = Path(output_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ Checkpoints


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint directory (``checkpoints/step-00000100``), or None."""
    found = sorted((Path(output_dir) / CHECKPOINTS).glob("step-*"))
    return found[-1] if found else None


def _counter_ok(value: Any, default: Any) -> bool:
    """A non-negative number of the counter's kind (an int where the default is one), or None where the
    default is None."""
    if value is None or type(value) not in (int, float):  # (not a bool either)
        return value is None and default is None
    return value >= 0 and (type(value) is int or type(default) is not int)


def read_checkpoint_record(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of the checkpoint ``path``, checked: the counters are plain numbers."""
    file, want = path / STATE_FILE, vars(TrainState())
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        why = f"is not a gqakit training state (non-negative numbers under {', '.join(want)})"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        data, why = None, f"cannot be read ({type(e).__name__}): the checkpoint is incomplete or damaged"
    if isinstance(data, dict) and all(k in data and _counter_ok(data[k], d) for k, d in want.items()):
        return data
    raise GqakitError(
        f"{file} {why}. Remove {path} to resume from the one before it, or start over without --resume."
    )


def _sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _files(acc: Any, model: torch.nn.Module) -> tuple[str, str, str]:
    """The model's, the optimizer's and this process's RNG file names (FSDP: per rank, all three)."""
    rank = acc.process_index
    if _sharded(model):
        return f"model_shard_{rank}.safetensors", f"optimizer_shard_{rank}.pt", f"rng_state_{rank}.pt"
    return "model.safetensors", "optimizer.pt", f"rng_state_{rank}.pt"


def _local(value: Any) -> Any:
    """This rank's part of a tensor (its shard of a DTensor), as a CPU copy of its own."""
    if not isinstance(value, torch.Tensor):
        return value
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.detach().to("cpu", copy=True).contiguous()


def save_checkpoint(run: Any) -> None:
    """``checkpoints/step-NNNNNNNN``, written by every process (its model and optimizer shards under FSDP,
    its RNG state; the main process the rest) into the temporary directory of
    :func:`gqakit.storage.atomic_output_dir`, renamed into place once all have: a kill leaves the whole
    checkpoint or none. Only the newest ``checkpoint.keep`` stay."""
    acc, step, optimizer = run.acc, run.state.step, run.optimizer
    root, model = run.out / CHECKPOINTS, acc.unwrap_model(run.model)
    model_file, optimizer_file, rng_file = _files(acc, model)
    dst = root / f"step-{step:08d}"
    with atomic_output_dir(dst, force=True) if acc.is_main_process else contextlib.nullcontext():
        acc.wait_for_everyone()
        tmp = partial_dir(dst)
        if _sharded(model):  # every rank its own shards, as plain tensors
            save_file({k: _local(v) for k, v in model.state_dict().items()}, str(tmp / model_file))
            state = optimizer.state_dict()
            state["state"] = {i: {k: _local(v) for k, v in s.items()} for i, s in state["state"].items()}
            torch.save(state, tmp / optimizer_file)
        elif acc.is_main_process:  # DDP: every process holds the same model and optimizer state
            save_model(model, str(tmp / model_file))
            torch.save(optimizer.state_dict(), tmp / optimizer_file)
        if acc.is_main_process:
            record = {**asdict(run.state), "tokens": run.budget.tokens(step), "processes": acc.num_processes}
            (tmp / STATE_FILE).write_text(json.dumps(record))
        torch.save(rng_state(), tmp / rng_file)
        acc.wait_for_everyone()
    if acc.is_main_process:
        for old in sorted(root.glob("step-*"))[: -run.recipe.checkpoint.keep or None]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()


def load_checkpoint(run: Any, path: Path, counters: bool = True) -> None:
    """Restore the model, optimizer and RNG from the checkpoint ``path`` and the counters (checked: plain
    numbers); with ``counters=False`` only the step comes back (a rollback keeps its counters). Only what
    :func:`save_checkpoint` wrote is read: any other file there (accelerate's pickles, say) is never opened.
    """
    record = read_checkpoint_record(path)
    acc, optimizer, model = run.acc, run.optimizer, run.acc.unwrap_model(run.model)
    model_file, optimizer_file, rng_file = _files(acc, model)
    missing = [n for n in (rng_file, model_file, optimizer_file) if not (path / n).is_file()]
    if missing:
        raise GqakitError(
            f"The checkpoint {path} lacks {', '.join(missing)}: it is incomplete. Remove it to resume "
            "from the one before it, or start over with --force."
        )
    name, why = model_file, "is not a safetensors file of this model"
    try:
        if _sharded(model):
            tensors = load_file(str(path / model_file))
            with torch.no_grad():
                for key, value in model.state_dict().items():
                    (value.to_local() if isinstance(value, DTensor) else value).copy_(tensors[key])
        else:
            load_model(model, str(path / model_file))
        # torch refuses a pickle with code in it: UnpicklingError and friends
        name, why = optimizer_file, "is not plain optimizer state"
        optimizer.load_state_dict(torch.load(path / optimizer_file, map_location="cpu", weights_only=True))
        name, why = rng_file, "is not plain RNG state"
        set_rng_state(torch.load(path / rng_file, weights_only=True))
    except Exception as e:
        raise GqakitError(
            f"The checkpoint {path} could not be loaded safely: {name} {why} ({type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0]}). gqakit loads checkpoints without running code from "
            "them; remove the checkpoint to resume from an earlier one, or start over without --resume."
        ) from None
    for param, state in optimizer.state.items():  # each shard back into a DTensor like its parameter's
        for k, v in state.items():
            if isinstance(param, DTensor) and v.shape == param.to_local().shape:
                state[k] = DTensor.from_local(
                    v, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )
    if counters:
        run.state = TrainState(**{k: record[k] for k in asdict(run.state)})
    else:
        run.state.step = record["step"]
    # accelerate counts micro-steps to know when gradients sync; a step is grad_accum of them.
    acc.step = run.state.step * run.recipe.train.grad_accum


def whole_state_dict(acc: Any, model: Any) -> dict[str, torch.Tensor]:
    """The model's whole tensors, to save it: under FSDP2 gathered to the main process (the others get
    an empty dict)."""
    if not _sharded(acc.unwrap_model(model)):
        return acc.get_state_dict(model)
    # deferred: torch.distributed.checkpoint takes a while to import
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as numbers and tensors (read back with ``weights_only=True``)."""
    name, keys, *rest = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), *rest)}
    state["torch"] = torch.get_rng_state()
    for kind, module in _ACCELERATOR_RNG.items():
        if module is not None and module.is_available():
            state[kind] = module.get_rng_state_all()
    return state


def set_rng_state(state: Any) -> None:
    """Restore what :func:`rng_state` saved (KeyError, TypeError, ValueError for anything else)."""
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    for kind, module in _ACCELERATOR_RNG.items():
        if module is not None and module.is_available() and kind in state:
            module.set_rng_state_all(state[kind])


def resume_run(run: Any) -> None:
    """Restore the newest checkpoint (model, optimizer, schedule, RNG, data position), if there is one."""
    ckpt = latest_checkpoint(run.out)
    if ckpt is None:
        log.info("no checkpoint in %s yet: starting from the beginning", run.out / CHECKPOINTS)
        truncate_records(run, -1)  # a run killed before its first checkpoint logged steps
        return
    load_checkpoint(run, ckpt)
    truncate_records(run, run.state.step)
    log.info("resumed from %s: %s", ckpt, run.budget.progress(run.state.step))


def rollback(run: Any) -> None:
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
            f"{s.step}. Lower train.lr, raise train.warmup_fraction, or use train.precision=fp32."
        )
    load_checkpoint(run, ckpt, counters=False)
    s.lr_scale, s.rollbacks = s.lr_scale * g.lr_factor, s.rollbacks + 1
    log.warning("rolled back to %s; learning rate now x%g", ckpt.name, s.lr_scale)
    # The steps past the checkpoint are run again, as after a resume: their records go, so the history
    # holds each step once (the rollback record says what happened).
    truncate_records(run, s.step)
    write_record(run, {"step": s.step, "event": "rollback", "checkpoint": ckpt.name, "lr_scale": s.lr_scale})
