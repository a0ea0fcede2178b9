"""``gqakit eval``: its options come from :class:`~gqakit.eval.options.EvalOptions`; it calls
:func:`gqakit.eval.api.evaluate`, writes the report and prints its headline table."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from gqakit.cli_options import click_options, options_from
from gqakit.eval.api import EvalOptions, evaluate
from gqakit.eval.report import headline_table, write_report
from gqakit.storage import writable_dir


@click.command("eval")
@click.argument("model")
@click.option("--baseline", help="Checkpoint to compare MODEL with (directory or hub id).")
@click_options(EvalOptions)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default="report",
    show_default=True,
    help="Directory for report.md, results.json and the plots.",
)
def eval_cmd(model: str, baseline: str | None, out: Path, **kwargs) -> None:
    """Measure MODEL (and --baseline): perplexity, lm-eval tasks, decode speed and KV memory.

    \b
    gqakit eval ./smollm2-mqa --baseline ./smollm2 --ppl-data wiki.test.txt --bench --out report/
    gqakit eval ./llama2-gqa8 --baseline ./Llama-2-7b-hf --tasks hellaswag,arc_easy --device cuda
    gqakit eval ./smollm2-mqa --baseline ./smollm2-mha --engine llamacpp --bench --contexts 512,2048,4096
    gqakit eval ./smollm2-mqa --baseline ./smollm2-mha --engine vllm --bench --batch-sizes 1,8,32,128
    """
    writable_dir(out, "--out")  # before the evaluation, not after it
    command_line = " ".join(shlex.quote(a) for a in ["gqakit", *sys.argv[1:]])
    options = options_from(EvalOptions, kwargs, command_line=command_line)
    results = evaluate(model, baseline, options)
    report = write_report(results, out)
    click.echo(headline_table(results))
    click.echo(f"\nWrote {report}, {report.parent / 'results.json'} and the plots.")
