"""``gqakit uptrain RECIPE [key.sub=value ...] [--resume | --force]``: parse, call ``uptrain``, print.
With ``--accelerate-config FILE``: check the config first (:func:`launch_problems`: what would fail late
or never under ``accelerate launch`` alone), then hand over to this Python's ``accelerate launch``."""

from __future__ import annotations

import os
import sys
from typing import Any

import click
import torch

from gqakit.errors import GqakitError
from gqakit.uptrain.plan import plan, truthy
from gqakit.uptrain.preflight import DEEPSPEED_RETIRED, process_state
from gqakit.uptrain.recipe import load_recipe, read_mapping
from gqakit.uptrain.train import uptrain


@click.command("uptrain")
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
@click.option(
    "--set", "settings", multiple=True, metavar="KEY=VALUE",
    help="A recipe override, as OVERRIDES are (repeatable): --set train.lr=3e-4.",
)  # fmt: skip
@click.option("--resume", is_flag=True, help="Continue the run in output_dir from its newest checkpoint.")
@click.option("--force", is_flag=True, help="Delete a non-empty output_dir and start over.")
@click.option("--print-recipe", is_flag=True, help="Print the resolved recipe (overrides applied) and exit.")
@click.option(
    "--accelerate-config",
    type=click.Path(dir_okay=False),
    help="Check this accelerate config (machine 0's address set? the GPUs it asks for here?), then run the "
    "recipe under `accelerate launch` (this Python's) with it.",
)
@click.option(
    "--machine-rank", type=int, help="With --accelerate-config on several machines: this one's rank."
)
@click.option("--main-process-ip", help="With --accelerate-config on several machines: machine 0's address.")
@click.option(
    "--plan",
    "plan_only",
    is_flag=True,
    help="Print the memory per process (under --accelerate-config) and the budget's GPU-hours, from the "
    "model's config.json alone, and exit: no weights read, nothing trained or written.",
)
@click.option(
    "--tokens", type=click.FloatRange(min=1), help="With --plan: cost this many tokens instead of the budget."
)
def uptrain_cmd(
    recipe: str,
    overrides: tuple[str, ...],
    settings: tuple[str, ...],
    resume: bool,
    force: bool,
    print_recipe: bool,
    accelerate_config: str | None,
    machine_rank: int | None,
    main_process_ip: str | None,
    plan_only: bool,
    tokens: float | None,
) -> None:
    """Uptrain a (converted) model as RECIPE says; OVERRIDES are key.sub=value pairs.

    \b
    One process:      gqakit uptrain recipes/smollm2-135m-mqa.yaml train.lr=3e-4
    Many processes:   gqakit uptrain recipes/llama2-7b-gqa8.yaml \\
                          --accelerate-config recipes/accelerate/fsdp.yaml
                      (or: accelerate launch --config_file recipes/accelerate/fsdp.yaml \\
                          -m gqakit.uptrain recipes/llama2-7b-gqa8.yaml)
    After a kill:     gqakit uptrain recipes/smollm2-135m-mqa.yaml --resume
    Before a launch:  gqakit uptrain recipes/llama2-7b-gqa8.yaml --plan \\
                          --accelerate-config recipes/accelerate/fsdp.yaml
    """
    overrides = (*overrides, *settings)
    rec = load_recipe(recipe, overrides)
    if print_recipe:
        click.echo(rec.to_yaml(), nl=False)
        return
    launch = None
    if accelerate_config:
        launch = read_mapping(accelerate_config, "--accelerate-config", "accelerate settings")
    if plan_only:
        click.echo(plan(rec, launch, int(tokens) if tokens else None).to_text())
        return
    if launch is not None:
        problems = launch_problems(launch, main_process_ip)
        if problems:
            raise GqakitError(f"--accelerate-config {accelerate_config}: " + " ".join(problems))
        # this Python's accelerate, not a PATH lookup (a virtual environment need not be activated)
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config]
        for flag, value in (("--machine_rank", machine_rank), ("--main_process_ip", main_process_ip)):
            argv += [flag, str(value)] if value is not None else []
        argv += ["-m", "gqakit.uptrain", recipe, *overrides, *["--resume"] * resume, *["--force"] * force]
        os.execve(argv[0], argv, launch_env(launch))  # replaces this process (tests stub it)
        return

    try:
        res = uptrain(rec, resume=resume, force=force)
    except RuntimeError as e:
        # a collective failing for a lost peer: the connection reset (gloo, NCCL) or the collective timing
        # out (GQAKIT_COLLECTIVE_TIMEOUT seconds, default 600)
        dist, text = torch.distributed, str(e)
        lost = isinstance(e, dist.DistError) or any(
            k in text for k in ("gloo", "NCCL", "Timed out", "Connection")
        )
        if not (dist.is_initialized() and lost):
            raise
        raise GqakitError(
            "This run lost another of its processes (a machine or process that stopped, or stopped "
            f"answering): {str(e).splitlines()[0]} This process stopped too. Continue the run from its last "
            "checkpoint with the same command and --resume, on every machine."
        ) from None

    if process_state().is_main_process:
        alpha = f", alpha {res.alpha:.3g}" if res.alpha is not None else ""
        before = f"{res.initial_val_ppl:.3f} -> " if res.initial_val_ppl is not None else ""
        click.echo(
            f"uptrained {res.steps:,} steps ({res.tokens:,} tokens{alpha}) in {res.elapsed_s:.0f}s; "
            f"validation perplexity {before}{res.final_val_ppl:.3f}; model in {res.output_dir}"
        )


def launch_env(config: dict[str, Any]) -> dict[str, str]:
    """The environment the launched processes run in: this one, plus ``ACCELERATE_USE_CPU=true`` for a
    config with ``use_cpu: true`` (accelerate's multi-process launcher does not pass that key on, and its
    processes would each run alone on the CPU)."""
    return {**os.environ, **({"ACCELERATE_USE_CPU": "true"} if truthy(config.get("use_cpu")) else {})}


# The address recipes/accelerate/multi-node.yaml ships with: to be replaced by machine 0's.
PLACEHOLDER_IPS = ("10.0.0.1", "", "MACHINE_0_ADDRESS")
# The distributed types whose processes each take a GPU unless the config says use_cpu.
_GPU_TYPES = ("MULTI_GPU", "FSDP")


def launch_problems(
    config: dict[str, Any], main_process_ip: str | None = None, gpus: int | None = None
) -> list[str]:
    """Why the accelerate config ``config`` would not start one distributed run on this machine (``gpus``
    GPUs; default: ``torch.cuda.device_count()``), each with what to use instead; empty when it would.

    DeepSpeed is refused (:data:`DEEPSPEED_RETIRED`); a multi-machine config whose ``main_process_ip`` is
    the shipped placeholder would retry the rendezvous forever; without GPUs and ``use_cpu: true``
    accelerate starts a multi-process config as N independent single-process runs; more GPUs than this
    machine has fails inside torchrun.
    """
    gpus = torch.cuda.device_count() if gpus is None else gpus
    kind = str(config.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        return [DEEPSPEED_RETIRED]
    try:
        machines = max(1, int(config.get("num_machines", 1) or 1))
        processes = int(config.get("num_processes", 1) or 1)
    except (TypeError, ValueError):
        return [
            f"num_machines and num_processes must be whole numbers, got {config.get('num_machines')!r} and "
            f"{config.get('num_processes')!r}."
        ]
    problems = []
    ip = main_process_ip if main_process_ip is not None else str(config.get("main_process_ip") or "")
    if machines > 1 and ip in PLACEHOLDER_IPS:
        problems.append(
            f"num_machines is {machines} but main_process_ip is {ip or 'not set'!r}, the shipped "
            "placeholder: pass --main-process-ip with machine 0's address (reachable from the others), "
            "or set main_process_ip in the config. Also set --machine-rank on every machine."
        )
    # ACCELERATE_USE_CPU=1 in the environment reaches every process too (docs/uptrain.md's 2 CPU ranks)
    cpu = truthy(config.get("use_cpu")) or truthy(os.environ.get("ACCELERATE_USE_CPU"))
    if cpu or kind not in _GPU_TYPES:
        return problems
    here = max(1, processes // machines)  # num_processes counts every machine's
    ids = str(config.get("gpu_ids", "all") or "all")
    listed = [int(i) for i in ids.split(",") if i.strip().isdigit()] if ids != "all" else []
    if gpus == 0 and (here > 1 or machines > 1):
        problems.append(
            f"distributed_type {kind} with num_processes {processes} puts each process on a GPU, and this "
            "machine has no GPU: accelerate would start each process as an independent single-process run "
            "(rank 0 of 1), not one distributed run. Without GPUs use recipes/accelerate/fsdp-cpu.yaml "
            "(FSDP2 over 2 CPU processes; or set `use_cpu: true` in this config), run on a machine with "
            f"{here} GPUs, or leave out --accelerate-config to train in one process."
        )
    elif gpus and here > gpus:
        problems.append(
            f"distributed_type {kind} starts {here} processes on this machine, one per GPU, and this "
            f"machine has {gpus} GPU(s): set num_processes: {gpus * machines} in the config, or run on a "
            f"machine with {here} GPUs."
        )
    elif gpus and any(i >= gpus for i in listed):
        problems.append(
            f"gpu_ids is {ids} and this machine has GPU(s) 0 to {gpus - 1}: set gpu_ids to GPUs it has "
            "(or all)."
        )
    return problems
