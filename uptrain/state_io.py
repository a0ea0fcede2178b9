"""The files of a resumable checkpoint, each written and read back without running code from it.

Run directories are shared (multi-node training needs a shared ``output_dir``) and downloaded, so a
resume must not unpickle anything that can carry code. accelerate's ``load_state`` does in three places:
registered custom objects (``custom_checkpoint_*.pkl``, ``weights_only=False``), FSDP's sharded
checkpoints (``torch.distributed.checkpoint`` reads ``.metadata`` with ``pickle.load`` and non-tensor
entries with ``weights_only=False``) and DeepSpeed's engine checkpoints (DeepSpeed's own loader). gqakit
therefore writes and reads the pieces itself::

    step-NNNNNNNN/
      model.safetensors          safetensors (FSDP: accelerate's per-rank files, see below)
      optimizer.pt               torch.save of the optimizer state; read with torch.load(weights_only=True)
      scaler.json                fp16 only: the gradient scaler's numbers
      rng_state_<rank>.json      Python, NumPy, torch and accelerator RNG states, as numbers
      trainer_state.json         gqakit's counters (:mod:`gqakit.uptrain.run_checkpoints`)

Under FSDP the model and optimizer go through accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer``
with ``use_dcp=False``: per-rank ``torch.save`` files that ``load_fsdp_*`` read with
``torch.load(weights_only=True)``. DeepSpeed's checkpoints can only be read by DeepSpeed's unpickling
loader, so gqakit does not checkpoint under DeepSpeed (:func:`deepspeed_problem`). The learning-rate
schedule is a pure function of the step and needs no file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from gqakit.errors import GqakitError

MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
SCALER = "scaler.json"
# What accelerate's save_state wrote (gqakit before pickle-free checkpoints): never read.
LEGACY = ("optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl")


# The accelerators whose RNG states a checkpoint keeps besides the CPU's: name -> torch module.
_ACCELERATOR_RNG = {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None)}


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.json"


_NO_DEEPSPEED = (
    "DeepSpeed's checkpoints can only be read back by DeepSpeed's own loader, which unpickles them (code "
    "in a run directory would run), and gqakit never loads code from a run directory. Set "
    "checkpoint.every=0 (no --resume, no rollback), or use recipes/accelerate/fsdp.yaml (sharded like "
    "ZeRO-3, resumable)."
)


def deepspeed_problem(every: int) -> str | None:
    """Why a DeepSpeed run cannot checkpoint every ``every`` steps (None when it does not try to)."""
    return f"checkpoint.every={every} under DeepSpeed: {_NO_DEEPSPEED}" if every else None


def _is(acc: Any, kind: str) -> bool:
    return acc.distributed_type.value == kind


# ---------------------------------------------------------------------------------------------------
# Writing (every process calls these; each writes its own part)
# ---------------------------------------------------------------------------------------------------


def save_training_state(acc: Any, model: Any, optimizer: Any, directory: Path) -> None:
    """Write the model, optimizer, gradient scaler and this process's RNG state into ``directory``."""
    if _is(acc, "DEEPSPEED"):
        raise GqakitError(f"No resumable checkpoints under DeepSpeed: {_NO_DEEPSPEED}")
    if _is(acc, "FSDP"):
        # deferred: accelerate takes seconds to import
        from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

        plugin = acc.state.fsdp_plugin
        save_fsdp_model(plugin, acc, model, str(directory), use_dcp=False)
        save_fsdp_optimizer(plugin, acc, optimizer, model, str(directory), use_dcp=False)
    elif acc.is_main_process:  # DDP: every process holds the same model and optimizer state
        save_model(acc.unwrap_model(model), str(directory / MODEL))
        torch.save(optimizer.state_dict(), directory / OPTIMIZER)
    if acc.is_main_process and acc.scaler is not None:
        (directory / SCALER).write_text(json.dumps(acc.scaler.state_dict()))
    (directory / rng_file(acc.process_index)).write_text(json.dumps(rng_state()))


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as JSON numbers."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    for kind, module in _ACCELERATOR_RNG.items():
        if module is not None and module.is_available():
            state[kind] = [s.tolist() for s in module.get_rng_state_all()]
    return state


# ---------------------------------------------------------------------------------------------------
# Reading: safetensors, torch.load(weights_only=True) and JSON only
# ---------------------------------------------------------------------------------------------------


def _unreadable(directory: Path, name: str, why: str) -> GqakitError:
    return GqakitError(
        f"The checkpoint {directory} could not be loaded safely: {name} {why}. gqakit loads checkpoints "
        "without running code from them; remove the checkpoint to resume from an earlier one, or start "
        "over without --resume."
    )


def required_files(acc: Any) -> list[str]:
    """The files of a checkpoint that this process reads, besides ``trainer_state.json``."""
    files = [rng_file(acc.process_index)]
    if not _is(acc, "FSDP"):
        files += [MODEL, OPTIMIZER]
    if acc.scaler is not None:
        files.append(SCALER)
    return files


def load_training_state(acc: Any, model: Any, optimizer: Any, directory: Path) -> None:
    """Read back what :func:`save_training_state` wrote; any other file in ``directory`` is ignored."""
    if _is(acc, "DEEPSPEED"):
        raise GqakitError(f"No resumable checkpoints under DeepSpeed: {_NO_DEEPSPEED}")
    missing = [n for n in required_files(acc) if not (directory / n).is_file()]
    if missing:
        legacy = [n for n in LEGACY if (directory / n).is_file()]
        why = (
            f"was written by an older gqakit in accelerate's pickle format ({', '.join(legacy)}), which "
            "gqakit no longer reads: start over with --force"
            if legacy
            else "is incomplete: remove it to resume from the one before it, or start over with --force"
        )
        raise GqakitError(f"The checkpoint {directory} lacks {', '.join(missing)}: it {why}.")
    if _is(acc, "FSDP"):
        # deferred: accelerate takes seconds to import
        from accelerate.utils import load_fsdp_model, load_fsdp_optimizer

        plugin = acc.state.fsdp_plugin
        try:  # accelerate's per-rank files, read with torch.load(weights_only=True)
            load_fsdp_model(plugin, acc, model, str(directory), use_dcp=False)
            load_fsdp_optimizer(plugin, acc, optimizer, model, str(directory), use_dcp=False)
        except Exception as e:  # a missing file, or torch refusing a pickle with code in it
            first = str(e).splitlines()[0] if str(e) else ""
            why = f"cannot be read as plain tensors ({type(e).__name__}: {first})"
            raise _unreadable(directory, "the FSDP model or optimizer files", why) from None
    else:
        try:
            load_model(acc.unwrap_model(model), str(directory / MODEL))
        except Exception as e:
            raise _unreadable(directory, MODEL, f"is not a safetensors file of this model ({e})") from None
        try:
            state = torch.load(directory / OPTIMIZER, map_location="cpu", weights_only=True)
            optimizer.load_state_dict(state)
        except Exception as e:  # torch refuses a pickle with code in it: UnpicklingError and friends
            first = str(e).splitlines()[0] if str(e) else ""
            raise _unreadable(
                directory, OPTIMIZER, f"is not plain optimizer state ({type(e).__name__}: {first})"
            ) from None
    if acc.scaler is not None:
        acc.scaler.load_state_dict(_json(directory, SCALER))
    name = rng_file(acc.process_index)
    try:
        set_rng_state(_json(directory, name))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise _unreadable(directory, name, f"is not what gqakit writes ({type(e).__name__}: {e})") from None


def _json(directory: Path, name: str) -> Any:
    try:
        return json.loads((directory / name).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _unreadable(directory, name, f"is not JSON ({type(e).__name__})") from None


def set_rng_state(state: Any) -> None:
    """Restore :func:`rng_state`'s numbers (KeyError, TypeError, ValueError for anything else)."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss)))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    keys = np.asarray(keys, dtype=np.uint32)
    np.random.set_state((str(kind), keys, int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    for kind, module in _ACCELERATOR_RNG.items():
        if module is not None and module.is_available() and kind in state:
            module.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state[kind]])


__all__ = [
    "MODEL",
    "OPTIMIZER",
    "SCALER",
    "deepspeed_problem",
    "load_training_state",
    "required_files",
    "rng_file",
    "rng_state",
    "save_training_state",
    "set_rng_state",
]
