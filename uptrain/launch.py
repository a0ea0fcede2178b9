"""``gqakit uptrain RECIPE --accelerate-config FILE``: check an accelerate config, then launch on it.

``accelerate launch`` with a config that cannot run fails late or never: a DeepSpeed config without
DeepSpeed ends in an ImportError traceback, and a multi-machine config whose ``main_process_ip`` is still
the shipped placeholder makes every machine retry the rendezvous forever. gqakit reads the config first,
reports every such problem with the key to fill in or the package to install, and only then hands over
to ``accelerate launch ... -m gqakit.uptrain RECIPE``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import yaml

from gqakit.errors import GqakitError
from gqakit.uptrain.preflight import deepspeed_problems
from gqakit.uptrain.recipe import Recipe

# The address recipes/accelerate/multi-node.yaml ships with: to be replaced by machine 0's.
PLACEHOLDER_IPS = ("10.0.0.1", "", "MACHINE_0_ADDRESS")


def read_accelerate_config(path: str | Path) -> dict[str, Any]:
    p = Path(path).expanduser()
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise GqakitError(f"--accelerate-config {path} cannot be read ({e.strerror}).") from None
    except yaml.YAMLError as e:
        raise GqakitError(f"--accelerate-config {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise GqakitError(f"--accelerate-config {path} is not a mapping of accelerate settings.")
    return data


def accelerate_config_problems(
    config: dict[str, Any], main_process_ip: str | None = None, recipe: Recipe | None = None
) -> list[str]:
    """What stops ``config`` (with ``recipe``) from running here, each with its fix; empty when it can be
    launched."""
    problems = []
    deepspeed = str(config.get("distributed_type", "")).upper() == "DEEPSPEED"
    if deepspeed and not importlib.util.find_spec("deepspeed"):
        problems.append(
            "distributed_type DEEPSPEED needs DeepSpeed, which is not installed: pip install deepspeed."
        )
    if deepspeed and recipe is not None:
        problems += deepspeed_problems(recipe)
    try:
        machines = int(config.get("num_machines", 1) or 1)
    except (TypeError, ValueError):
        return [*problems, f"num_machines must be a whole number, got {config.get('num_machines')!r}."]
    ip = main_process_ip if main_process_ip is not None else str(config.get("main_process_ip") or "")
    if machines > 1 and ip in PLACEHOLDER_IPS:
        problems.append(
            f"num_machines is {machines} but main_process_ip is {ip or 'not set'!r}, the shipped "
            "placeholder: pass --main-process-ip with machine 0's address (reachable from the others), "
            "or set main_process_ip in the config. Also set --machine-rank on every machine."
        )
    return problems


def launch_argv(
    config: str,
    recipe: str,
    overrides: tuple[str, ...],
    *,
    resume: bool = False,
    force: bool = False,
    machine_rank: int | None = None,
    main_process_ip: str | None = None,
) -> list[str]:
    """The ``accelerate launch`` command that runs the recipe under ``config``."""
    argv = ["accelerate", "launch", "--config_file", config]
    if machine_rank is not None:
        argv += ["--machine_rank", str(machine_rank)]
    if main_process_ip is not None:
        argv += ["--main_process_ip", main_process_ip]
    argv += ["-m", "gqakit.uptrain", recipe, *overrides]
    return argv + (["--resume"] if resume else []) + (["--force"] if force else [])


__all__ = ["accelerate_config_problems", "launch_argv", "read_accelerate_config"]
