"""``gqakit uptrain RECIPE [key.sub=value ...] [--resume | --force]``: parse, call ``uptrain``, print."""

from __future__ import annotations

import click

from gqakit.uptrain.recipe import load_recipe


@click.command("uptrain", context_settings={"ignore_unknown_options": False})
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
@click.option("--resume", is_flag=True, help="Continue the run in output_dir from its newest checkpoint.")
@click.option("--force", is_flag=True, help="Delete a non-empty output_dir and start over.")
@click.option("--print-recipe", is_flag=True, help="Print the resolved recipe (overrides applied) and exit.")
def uptrain_cmd(
    recipe: str, overrides: tuple[str, ...], resume: bool, force: bool, print_recipe: bool
) -> None:
    """Uptrain a (converted) model as RECIPE says; OVERRIDES are key.sub=value pairs.

    \b
    One process:      gqakit uptrain recipes/smollm2-135m-mqa.yaml train.lr=3e-4
    Many processes:   accelerate launch --config_file recipes/accelerate/fsdp.yaml \\
                          -m gqakit.uptrain recipes/llama2-7b-gqa8.yaml
    After a kill:     gqakit uptrain recipes/smollm2-135m-mqa.yaml --resume
    """
    rec = load_recipe(recipe, list(overrides))
    if print_recipe:
        click.echo(rec.to_yaml(), nl=False)
        return
    from gqakit.uptrain.api import process_state, uptrain

    res = uptrain(rec, resume=resume, force=force)

    if process_state().is_main_process:
        alpha = f", alpha {res.alpha:.3g}" if res.alpha is not None else ""
        before = f"{res.initial_val_ppl:.3f} -> " if res.initial_val_ppl is not None else ""
        click.echo(
            f"uptrained {res.steps:,} steps ({res.tokens:,} tokens{alpha}) in {res.elapsed_s:.0f}s; "
            f"validation perplexity {before}{res.final_val_ppl:.3f}; model in {res.output_dir}"
        )
