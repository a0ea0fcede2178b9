"""``preflight(recipe)``: everything an uptraining run checks before it writes, converts, loads a model or
trains, reported as one message with every problem in it: what the recipe points at (model, teacher,
data), the machine, the output directory and, for ``--resume``, the run being continued. (The recipe's own
keys, types and cross-field rules were checked when it was loaded: :mod:`gqakit.uptrain.recipe`.)
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from gqakit.checkpoint import model_source, read_config
from gqakit.convert.retarget import groups_problem
from gqakit.errors import GqakitError
from gqakit.models import check_causal_lm, check_seq_len, device_unavailable, load_tokenizer, resolve_device
from gqakit.storage import writable_dir
from gqakit.text import load_texts
from gqakit.uptrain.checkpoints import PROVENANCE, latest_checkpoint, read_checkpoint_record
from gqakit.uptrain.data import BUILDERS, build_blocks, resolve_files
from gqakit.uptrain.recipe import expand, read_mapping
from gqakit.uptrain.recipe_schema import Recipe
from gqakit.uptrain.schedule import resolve_budget

# What a resumed run may change: how long it trains (a longer budget stretches the cosine schedule from
# the resumed step on), how often it evaluates, logs and checkpoints, how fast it runs, the saved dtype,
# tokenization workers and where the run directory now lies. Anything else (data, batch, lr, schedule
# shape, objective, model, seed...) would make the resumed run another run than its checkpoints', with
# wrong token counts.
RESUME_SAFE: tuple[str, ...] = (
    "budget.steps", "budget.tokens", "budget.alpha", "eval.", "log.", "checkpoint.", "speed.",
    "model.save_dtype", "data.num_proc", "output_dir",
)  # fmt: skip


def preflight(recipe: Recipe, *, resume: bool = False, force: bool = False) -> None:
    """Check everything a run needs before any work, in every process of a launch.

    Raises:
        GqakitError: every problem, one per line.
    """
    missing = device_unavailable(recipe.speed.device)
    # on the device the run will train on (one this machine lacks: reported with the other problems)
    state = process_state(None if missing else recipe.speed.device)
    out = Path(expand(recipe.output_dir)).resolve()
    problems = [
        *([missing] if missing else []),
        *input_problems(recipe),
        *environment_problems(recipe, state.distributed_type.value, state.device.type),
        *output_problems(recipe, out, resume, force),
    ]
    if resume and out.is_dir():
        problems += resume_problems(recipe, out, state.num_processes)
    if not problems:  # the files are readable: count the blocks they give
        problems += data_problems(recipe, state)
    if problems:
        lines = ["The recipe's inputs have problems:", *(f"  - {p}" for p in problems)]
        cache = os.environ.get("GQAKIT_CACHE")
        if any(".cache/gqakit" in p or (cache and cache in p) for p in problems):
            lines.append(
                "The shipped recipes read the demo assets: run `gqakit assets fetch` first, or override "
                "the paths (model.path=DIR teacher=DIR data.files=[...] data.val_files=[...])."
            )
        raise GqakitError("\n".join(lines))


def process_state(device: str | None = None):
    """accelerate's per-process state (rank, world size, device, barriers), as ``Accelerator`` will see it.

    ``PartialState()`` alone ignores ``ACCELERATE_USE_CPU`` (only ``AcceleratorState`` reads it), and the
    first call fixes the state for the whole process: a 2-process CPU launch would then run as two
    independent single processes. ``device``, a recipe's ``speed.device``, puts a single process there;
    None and ``auto`` leave it where it is (accelerate's choice, or the device a recipe put it on). A
    process trains on one device: a later recipe naming another is refused. The processes of a
    distributed launch stay where the launch put them.
    """
    # deferred: accelerate takes seconds to import
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = parse_flag_from_env("ACCELERATE_USE_CPU")
    # A lost peer ends the others' collectives after GQAKIT_COLLECTIVE_TIMEOUT seconds (default 10 minutes)
    # instead of torch's 30. The first PartialState creates the process group: Accelerator's is too late.
    timeout = timedelta(seconds=float(os.environ.get("GQAKIT_COLLECTIVE_TIMEOUT") or 600))
    state = PartialState(cpu=cpu, timeout=timeout)
    want = None if device in (None, "auto") else resolve_device(device)
    if want is None or state.use_distributed or state.device == want:
        return state
    if "gqakit_device" in PartialState._shared_state:
        raise GqakitError(
            f"speed.device={device}: this process already trains on {state.device}, and a process trains "
            "on one device. Run this recipe in a process of its own."
        )
    # One process holds no process group, so its state can be made again on the recipe's device.
    PartialState._reset_state()
    state = PartialState(cpu=want.type == "cpu")
    state.device = state.gqakit_device = want  # (an attribute of the shared state: reset with it)
    if want.type == "cuda" and want.index is not None:
        torch.cuda.set_device(want)  # what runs on "the current device" (autocast, compile) too
    return state


def input_problems(recipe: Recipe) -> list[str]:
    """What is wrong with the model, teacher and data files the recipe names."""
    problems: list[str] = []
    configs: dict[str, dict[str, Any]] = {}
    uses_teacher = bool(recipe.teacher) and recipe.objective.kind != "lm"
    for key, path in [("model.path", recipe.model.path), *([("teacher", recipe.teacher)] * uses_teacher)]:
        try:  # every form a command's SRC takes; a hub id's config is read when it loads
            local = Path(model_source(expand(path)))
            if local.is_dir():
                cfg = configs[key] = read_config(local)
                check_causal_lm(cfg, path, what=key.partition(".")[0])
                check_seq_len(SimpleNamespace(**cfg), recipe.data.seq_len, "data.seq_len")
        except GqakitError as e:
            problems.append(f"{key}: {e.message}")
    model_cfg, teacher_cfg = configs.get("model.path"), configs.get("teacher")
    if model_cfg and teacher_cfg and model_cfg.get("vocab_size") != teacher_cfg.get("vocab_size"):
        problems.append(
            f"teacher {recipe.teacher} has a vocabulary of {teacher_cfg.get('vocab_size')} tokens and the "
            f"model {recipe.model.path} one of {model_cfg.get('vocab_size')}: distillation compares their "
            "logits token by token, so the teacher must share the model's tokenizer (use the checkpoint the "
            "model was converted from)."
        )
    if model_cfg and recipe.model.convert is not None:
        problem = groups_problem(model_cfg, recipe.model.convert.groups)
        if problem:
            problems.append(f"model.convert.groups: {problem}")
    if not recipe.data.hub:
        d = recipe.data
        for key, patterns in (("data.files", d.files), ("data.val_files", d.val_files)):
            files = resolve_files(patterns, key, problems)
            if len({BUILDERS[Path(f).suffix.lower()] for f in files}) > 1:
                problems.append(f"{key} mixes file types ({', '.join(files)}); give files of one type.")
            for file in files:
                try:  # gqakit's one text loader: the same messages as eval for empty, binary, malformed
                    load_texts(file, d.text_field, option=key)
                except GqakitError as e:
                    problems.append(e.message)
    return problems


def data_problems(recipe: Recipe, state: Any) -> list[str]:
    """Whether the training text gives one batch for every process: the blocks are counted by packing the
    text as the run will (the main process first; ``datasets`` caches the blocks, which the run reads)."""
    try:
        tokenizer = load_tokenizer(model_source(expand(recipe.model.path)))  # a conversion keeps it
        with state.main_process_first():
            blocks = build_blocks(recipe.data, tokenizer, recipe.seed)
    except GqakitError as e:
        return [e.message]
    batch, world = recipe.train.batch_size, state.num_processes
    if len(blocks.train) >= batch * world:
        return []
    return [
        f"The training text gives {len(blocks.train)} block(s) of {recipe.data.seq_len} tokens, fewer than "
        f"one batch (train.batch_size={batch} x {world} process(es)). Add text, or lower data.seq_len or "
        "train.batch_size."
    ]


# ---------------------------------------------------------------------------------------------- The machine


def resolve_precision(precision: str, device: str = "auto") -> str:
    """``precision`` with ``auto`` resolved for ``device``: bf16 autocast where it has bf16 instructions (a
    CUDA GPU that supports it, a CPU with AVX-512 BF16 or AMX), else fp32. Other values pass through."""
    if precision != "auto":
        return precision
    if resolve_device(device).type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    try:
        return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    except (AttributeError, RuntimeError):
        return "fp32"


# DeepSpeed is retired: FSDP2 covers what it was used for (docs/uptrain.md#deepspeed).
DEEPSPEED_RETIRED = (
    "distributed_type DEEPSPEED is not supported: FSDP2 shards parameters, gradients and optimizer state as "
    "ZeRO-3 does, with resumable checkpoints read back without unpickling and the teacher sharded too. Use "
    "recipes/accelerate/fsdp.yaml (recipes/accelerate/fsdp-cpu.yaml on a machine without GPUs)."
)


def environment_problems(recipe: Recipe, distributed_type: str, device_type: str) -> list[str]:
    """What this machine and launch cannot run of the recipe (precision, DeepSpeed, a device for a
    distributed launch)."""
    problems = []
    # A run records the precision that ran: one the device would quietly replace is refused instead (auto
    # always resolves to a precision the device runs).
    if recipe.train.precision == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        problems.append("train.precision=bf16 needs a GPU with bfloat16 (Ampere or newer); use fp32.")
    if distributed_type == "DEEPSPEED":  # launched by accelerate launch directly
        problems.append(DEEPSPEED_RETIRED)
    if recipe.speed.device != "auto" and distributed_type != "NO":
        problems.append(
            f"speed.device={recipe.speed.device} puts a single process on a device; this run was launched "
            f"as {distributed_type}, whose processes take their devices from accelerate launch (--cpu, "
            "--gpu_ids): set speed.device=auto."
        )
    return problems


# ------------------------------------------------------ The run directory, and the run a --resume continues


def output_problems(recipe: Recipe, out: Path, resume: bool, force: bool) -> list[str]:
    """Refuse a non-empty run directory unless resuming or forcing, a finished run to resume, inputs
    inside it (``force`` would delete them) and a directory that cannot be written."""
    problems = []  # (a file there: writable_dir's message)
    d = recipe.data
    for item in [recipe.model.path, *([recipe.teacher] if recipe.teacher else []), *d.files, *d.val_files]:
        path = Path(expand(item)).resolve()
        if path == out or out in path.parents:
            problems.append(f"{item} is inside output_dir {out}: choose an output_dir outside the inputs.")
    busy = out.is_dir() and any(out.iterdir())
    if busy and resume and (out / PROVENANCE).is_file():
        problems.append(
            f"{out} holds a finished run ({PROVENANCE} is there): nothing to resume. Pass --force to train "
            "again from scratch, or choose another output_dir."
        )
    if busy and not (resume or force):
        problems.append(
            f"output_dir {out} exists and is not empty. Pass --resume to continue the run in it, --force to "
            "delete it and start over, or choose another output_dir (override output_dir=DIR)."
        )
    try:
        writable_dir(out, "output_dir")
    except GqakitError as e:
        problems.append(e.message)
    return problems


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested recipe as ``{"train.lr": 1e-4, ...}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def resume_problems(recipe: Recipe, out: Path, processes: int) -> list[str]:
    """Why ``--resume`` with ``recipe`` on ``processes`` processes would not continue the run in ``out``:
    a recipe that differs from the run's own (``OUTPUT_DIR/recipe.yaml``) outside :data:`RESUME_SAFE`,
    another number of processes, a budget the checkpoint has already passed."""
    problems = []
    saved_file = out / "recipe.yaml"
    if saved_file.is_file():
        try:
            saved = flat(read_mapping(saved_file, "", ""))
        except GqakitError:
            saved = {}
            problems.append(f"{saved_file} is not the recipe gqakit wrote: start over with --force.")
        now = flat(recipe.to_dict())
        changed = sorted(
            k
            for k in (saved.keys() | now.keys() if saved else ())
            if saved.get(k) != now.get(k) and not k.startswith(RESUME_SAFE)
        )
        if changed:
            diffs = ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in changed)
            safe = ", ".join(k + "*" if k.endswith(".") else k for k in RESUME_SAFE)
            problems.append(
                f"--resume continues the run in {out}, but the recipe differs from the one it started with "
                f"in {diffs}: the resumed run would not be the run its checkpoints belong to. Resume with "
                f"the same recipe (only {safe} may change; a longer budget stretches the cosine schedule "
                "from the resumed step on), or start over with --force or another output_dir."
            )
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        return problems
    try:
        record = read_checkpoint_record(ckpt)
    except GqakitError as e:
        return [*problems, e.message]
    saved_processes = record.get("processes")
    if saved_processes is not None and saved_processes != processes:
        problems.append(
            f"The checkpoint {ckpt} was written by {saved_processes} process(es) and this run has "
            f"{processes}: the global batch, each process's data and its RNG state would differ. Resume "
            f"with {saved_processes} processes (accelerate launch --num_processes {saved_processes}), or "
            "start over with --force."
        )
    t = recipe.train
    steps = resolve_budget(recipe.budget, t.batch_size * t.grad_accum * processes * recipe.data.seq_len).steps
    if steps < record["step"]:
        problems.append(
            f"The budget is {steps} steps but the checkpoint {ckpt.name} has already trained "
            f"{record['step']}: raise the budget (budget.steps={record['step'] + 1} or more) to go on."
        )
    return problems
