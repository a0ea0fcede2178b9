"""``gqakit uptrain RECIPE [key.sub=value ...] [--resume | --force]``: parse, call ``uptrain``, print."""

from __future__ import annotations

import os

import click

from gqakit.cli_options import force_option
from gqakit.errors import GqakitError
from gqakit.uptrain.api import process_state, uptrain
from gqakit.uptrain.launch import accelerate_config_problems, launch_argv, read_accelerate_config
from gqakit.uptrain.recipe import load_recipe


@click.command("uptrain", context_settings={"ignore_unknown_options": False})
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
@click.option("--resume", is_flag=True, help="Continue the run in output_dir from its newest checkpoint.")
@force_option("Delete a non-empty output_dir and start over.")
@click.option("--print-recipe", is_flag=True, help="Print the resolved recipe (overrides applied) and exit.")
@click.option(
    "--accelerate-config",
    type=click.Path(dir_okay=False),
    help="Check this accelerate config (DeepSpeed installed? machine 0's address set?), then run the recipe "
    "under `accelerate launch` with it.",
)
@click.option(
    "--machine-rank", type=int, help="With --accelerate-config on several machines: this one's rank."
)
@click.option("--main-process-ip", help="With --accelerate-config on several machines: machine 0's address.")
def uptrain_cmd(
    recipe: str,
    overrides: tuple[str, ...],
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
    rec = load_recipe(recipe, list(overrides))
    if print_recipe:
        click.echo(rec.to_yaml(), nl=False)
        return
    if accelerate_config:
        config = read_accelerate_config(accelerate_config)
        problems = accelerate_config_problems(config, main_process_ip, rec)
        if problems:
            raise GqakitError(f"--accelerate-config {accelerate_config}: " + " ".join(problems))
        argv = launch_argv(
            accelerate_config, recipe, overrides, resume=resume, force=force,
            machine_rank=machine_rank, main_process_ip=main_process_ip,
        )  # fmt: skip
        os.execvp(argv[0], argv)  # replaces this process; the return is for tests that stub it
        return

    res = uptrain(rec, resume=resume, force=force)

    if process_state().is_main_process:
        alpha = f", alpha {res.alpha:.3g}" if res.alpha is not None else ""
        before = f"{res.initial_val_ppl:.3f} -> " if res.initial_val_ppl is not None else ""
        click.echo(
            f"uptrained {res.steps:,} steps ({res.tokens:,} tokens{alpha}) in {res.elapsed_s:.0f}s; "
            f"validation perplexity {before}{res.final_val_ppl:.3f}; model in {res.output_dir}"
        )
