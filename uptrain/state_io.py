"""The files of a resumable checkpoint, each written and read back without running code from it.

Run directories are shared (multi-node training needs a shared ``output_dir``) and downloaded, so a
resume must not unpickle anything that can carry code. accelerate's ``load_state`` does in two places:
registered custom objects (``custom_checkpoint_*.pkl``, ``weights_only=False``) and FSDP's sharded
checkpoints (``torch.distributed.checkpoint`` reads ``.metadata`` with ``pickle.load`` and non-tensor
entries with ``weights_only=False``). gqakit therefore writes and reads the pieces itself::

    step-NNNNNNNN/
      model.safetensors          safetensors (FSDP: model_shard_<rank>.safetensors, each rank's shards)
      optimizer.pt               torch.save of the optimizer state; read with torch.load(weights_only=True)
                                 (FSDP: optimizer_shard_<rank>.pt, each rank's part)
      scaler.json                fp16 only: the gradient scaler's numbers
      rng_state_<rank>.json      Python, NumPy, torch and accelerator RNG states, as numbers
      trainer_state.json         gqakit's counters (:class:`TrainState`), checked plain numbers

Under FSDP2 (accelerate's on GPUs, gqakit's own ``fully_shard`` on CPUs) every parameter is a DTensor of
which each rank holds one shard: each rank writes and reads back its own shards as plain tensors, so a
resume needs the same number of processes. The learning-rate schedule is a pure function of the step
and needs no file.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch.distributed.tensor import DTensor

from gqakit.errors import GqakitError

# The run directory: the final model at its root, with these beside it.
PROVENANCE = "gqakit.json"  # written last: its presence marks a finished run
CHECKPOINTS = "checkpoints"  # checkpoints/step-NNNNNNNN/, renamed into place whole
STATE_FILE = "trainer_state.json"

MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
SCALER = "scaler.json"


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


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint directory (``checkpoints/step-00000100``), or None."""
    found = sorted((Path(output_dir) / CHECKPOINTS).glob("step-*"))
    return found[-1] if found else None


def _counter_ok(value: Any, default: Any) -> bool:
    """A non-negative number of the counter's kind (an int where the default is one), or None."""
    if value is None:
        return default is None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return False
    return isinstance(value, int) or not isinstance(default, int)


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


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.json"


# -------------------------------------------- Writing (every process calls these; each writes its own part)


def save_training_state(
    acc: Any, model: Any, optimizer: Any, directory: Path, record: dict[str, Any]
) -> None:
    """Write the model, optimizer, gradient scaler and this process's RNG state into ``directory``, and
    (main process) ``record``, the counters, as ``trainer_state.json``."""
    model = acc.unwrap_model(model)
    model_file, optimizer_file = _files(acc, model)
    if _sharded(model):  # every rank its own shards, as plain tensors
        save_file({k: _local(v) for k, v in model.state_dict().items()}, str(directory / model_file))
        state = optimizer.state_dict()
        state["state"] = {i: {k: _local(v) for k, v in s.items()} for i, s in state["state"].items()}
        torch.save(state, directory / optimizer_file)
    elif acc.is_main_process:  # DDP: every process holds the same model and optimizer state
        save_model(model, str(directory / model_file))
        torch.save(optimizer.state_dict(), directory / optimizer_file)
    if acc.is_main_process and acc.scaler is not None:
        (directory / SCALER).write_text(json.dumps(acc.scaler.state_dict()))
    if acc.is_main_process:
        (directory / STATE_FILE).write_text(json.dumps(record))
    (directory / rng_file(acc.process_index)).write_text(json.dumps(rng_state()))


def _sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def whole_state_dict(acc: Any, model: Any) -> dict[str, torch.Tensor]:
    """The model's whole tensors, to save it: under FSDP2 gathered to the main process (the others get
    an empty dict)."""
    if not _sharded(acc.unwrap_model(model)):
        return acc.get_state_dict(model)
    # deferred: torch.distributed.checkpoint takes a while to import
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _files(acc: Any, model: torch.nn.Module) -> tuple[str, str]:
    """The model's and the optimizer's file names: one of each, or one per rank under FSDP."""
    if _sharded(model):
        return f"model_shard_{acc.process_index}.safetensors", f"optimizer_shard_{acc.process_index}.pt"
    return MODEL, OPTIMIZER


def _local(value: Any) -> Any:
    """This rank's part of a tensor (its shard of a DTensor), as a CPU copy of its own."""
    if not isinstance(value, torch.Tensor):
        return value
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.detach().to("cpu", copy=True).contiguous()


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


# ---------------------------------------- Reading: safetensors, torch.load(weights_only=True) and JSON only


def _unreadable(directory: Path, name: str, why: str, e: BaseException | None = None) -> GqakitError:
    """The refusal of a checkpoint file: ``name`` ``why`` (with the first line of ``e``, when given)."""
    if e is not None:
        why += f" ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return GqakitError(
        f"The checkpoint {directory} could not be loaded safely: {name} {why}. gqakit loads checkpoints "
        "without running code from them; remove the checkpoint to resume from an earlier one, or start "
        "over without --resume."
    )


def load_training_state(acc: Any, model: Any, optimizer: Any, directory: Path) -> dict[str, Any]:
    """Read back what :func:`save_training_state` wrote, the counters first (checked: plain numbers) and
    returned; any other file in ``directory`` is ignored."""
    record = read_checkpoint_record(directory)
    model = acc.unwrap_model(model)
    model_file, optimizer_file = _files(acc, model)
    files = [rng_file(acc.process_index), model_file, optimizer_file, *([SCALER] if acc.scaler else [])]
    missing = [n for n in files if not (directory / n).is_file()]
    if missing:  # (accelerate's pickled files, which a checkpoint of another tool may hold, are never read)
        raise GqakitError(
            f"The checkpoint {directory} lacks {', '.join(missing)}: it is incomplete. Remove it to resume "
            "from the one before it, or start over with --force."
        )
    try:
        if _sharded(model):
            tensors = load_file(str(directory / model_file))
            with torch.no_grad():
                for name, value in model.state_dict().items():
                    (value.to_local() if isinstance(value, DTensor) else value).copy_(tensors[name])
        else:
            load_model(model, str(directory / model_file))
    except Exception as e:
        raise _unreadable(directory, model_file, "is not a safetensors file of this model", e) from None
    try:
        state = torch.load(directory / optimizer_file, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state)
    except Exception as e:  # torch refuses a pickle with code in it: UnpicklingError and friends
        raise _unreadable(directory, optimizer_file, "is not plain optimizer state", e) from None
    for param, state in optimizer.state.items():  # each shard back into a DTensor like its parameter's
        for k, v in state.items():
            if isinstance(param, DTensor) and v.shape == param.to_local().shape:
                state[k] = DTensor.from_local(
                    v, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )
    if acc.scaler is not None:
        acc.scaler.load_state_dict(_json(directory, SCALER))
    name = rng_file(acc.process_index)
    try:
        set_rng_state(_json(directory, name))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise _unreadable(directory, name, "is not what gqakit writes", e) from None
    return record


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
