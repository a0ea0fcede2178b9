"""``gqakit uptrain RECIPE [key.sub=value ...] [--resume | --force]``: parse, call ``uptrain``, print.

With ``--accelerate-config FILE`` it checks the accelerate config first and then hands over to
``accelerate launch --config_file FILE -m gqakit.uptrain RECIPE ...``, run by this Python
(``sys.executable -m accelerate.commands.launch``: no ``accelerate`` looked up on PATH, which fails in a
virtual environment that is not activated). A config that cannot run fails late or never under
``accelerate launch`` alone: a DeepSpeed config without DeepSpeed ends in an ImportError traceback, a
multi-machine config whose ``main_process_ip`` is still the shipped placeholder makes every machine
retry the rendezvous forever, and a multi-process FSDP/DDP config on a machine without the GPUs it
asks for starts N independent single-process runs; gqakit reports every such problem with the key to
fill in, the config to use or the package to install.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import click
import yaml

from gqakit.cli_options import force_option
from gqakit.errors import GqakitError
from gqakit.uptrain.preflight import deepspeed_problems, launch_problems, process_state, uses_cpu
from gqakit.uptrain.recipe import load_recipe
from gqakit.uptrain.recipe_schema import Recipe
from gqakit.uptrain.train import uptrain

# The address recipes/accelerate/multi-node.yaml ships with: to be replaced by machine 0's.
PLACEHOLDER_IPS = ("10.0.0.1", "", "MACHINE_0_ADDRESS")


@click.command("uptrain")
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
@click.option(
    "--set", "settings", multiple=True, metavar="KEY=VALUE",
    help="A recipe override, as OVERRIDES are (repeatable): --set train.lr=3e-4.",
)  # fmt: skip
@click.option("--resume", is_flag=True, help="Continue the run in output_dir from its newest checkpoint.")
@force_option("Delete a non-empty output_dir and start over.")
@click.option("--print-recipe", is_flag=True, help="Print the resolved recipe (overrides applied) and exit.")
@click.option(
    "--accelerate-config",
    type=click.Path(dir_okay=False),
    help="Check this accelerate config (DeepSpeed installed? machine 0's address set? the GPUs it asks for "
    "here?), then run the recipe under `accelerate launch` (this Python's) with it.",
)
@click.option(
    "--machine-rank", type=int, help="With --accelerate-config on several machines: this one's rank."
)
@click.option("--main-process-ip", help="With --accelerate-config on several machines: machine 0's address.")
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
) -> None:
    """Uptrain a (converted) model as RECIPE says; OVERRIDES are key.sub=value pairs.

    \b
    One process:      gqakit uptrain recipes/smollm2-135m-mqa.yaml train.lr=3e-4
    Many processes:   gqakit uptrain recipes/llama2-7b-gqa8.yaml \\
                          --accelerate-config recipes/accelerate/fsdp.yaml
                      (or: accelerate launch --config_file recipes/accelerate/fsdp.yaml \\
                          -m gqakit.uptrain recipes/llama2-7b-gqa8.yaml)
    After a kill:     gqakit uptrain recipes/smollm2-135m-mqa.yaml --resume
    """
    overrides = (*overrides, *settings)
    rec = load_recipe(recipe, overrides)
    if print_recipe:
        click.echo(rec.to_yaml(), nl=False)
        return
    if accelerate_config:
        problems = accelerate_config_problems(accelerate_config, main_process_ip, rec)
        if problems:
            raise GqakitError(f"--accelerate-config {accelerate_config}: " + " ".join(problems))
        # this Python's accelerate, not a PATH lookup (a virtual environment need not be activated)
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config]
        if machine_rank is not None:
            argv += ["--machine_rank", str(machine_rank)]
        if main_process_ip is not None:
            argv += ["--main_process_ip", main_process_ip]
        argv += ["-m", "gqakit.uptrain", recipe, *overrides]
        argv += (["--resume"] if resume else []) + (["--force"] if force else [])
        os.execve(argv[0], argv, launch_env(accelerate_config))  # replaces this process (tests stub it)
        return

    res = uptrain(rec, resume=resume, force=force)

    if process_state().is_main_process:
        alpha = f", alpha {res.alpha:.3g}" if res.alpha is not None else ""
        before = f"{res.initial_val_ppl:.3f} -> " if res.initial_val_ppl is not None else ""
        click.echo(
            f"uptrained {res.steps:,} steps ({res.tokens:,} tokens{alpha}) in {res.elapsed_s:.0f}s; "
            f"validation perplexity {before}{res.final_val_ppl:.3f}; model in {res.output_dir}"
        )


def accelerate_config_problems(path: str, main_process_ip: str | None, recipe: Recipe) -> list[str]:
    """What stops the accelerate config ``path`` (with ``recipe``) from running here, each with its fix;
    empty when it can be launched."""
    try:
        config = yaml.safe_load(Path(path).expanduser().read_text())
    except (OSError, yaml.YAMLError) as e:
        return [f"cannot be read as YAML ({getattr(e, 'strerror', None) or e})."]
    if not isinstance(config, dict):
        return ["is not a mapping of accelerate settings."]
    problems = []
    deepspeed = str(config.get("distributed_type", "")).upper() == "DEEPSPEED"
    if deepspeed and not importlib.util.find_spec("deepspeed"):
        problems.append(
            "distributed_type DEEPSPEED needs DeepSpeed, which is not installed: pip install deepspeed."
        )
    if deepspeed:
        problems += deepspeed_problems(recipe)
    try:
        machines = int(config.get("num_machines", 1) or 1)
    except (TypeError, ValueError):
        return [*problems, f"num_machines must be a whole number, got {config.get('num_machines')!r}."]
    ip = main_process_ip if main_process_ip is not None else str(config.get("main_process_ip") or "")
    problems += launch_problems(config)
    if machines > 1 and ip in PLACEHOLDER_IPS:
        problems.append(
            f"num_machines is {machines} but main_process_ip is {ip or 'not set'!r}, the shipped "
            "placeholder: pass --main-process-ip with machine 0's address (reachable from the others), "
            "or set main_process_ip in the config. Also set --machine-rank on every machine."
        )
    return problems


def launch_env(path: str) -> dict[str, str]:
    """The environment the launched processes run in: this one, plus ``ACCELERATE_USE_CPU=true`` for a
    config with ``use_cpu: true`` (accelerate's multi-process launcher does not pass that key on, and its
    processes would each run alone on the CPU)."""
    env = dict(os.environ)
    try:
        config = yaml.safe_load(Path(path).expanduser().read_text())
    except (OSError, yaml.YAMLError):
        return env
    if isinstance(config, dict) and uses_cpu(config):
        env["ACCELERATE_USE_CPU"] = "true"
    return env
