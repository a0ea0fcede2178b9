"""The ``gqakit`` command. Subcommands are imported only when invoked, so ``--help`` stays fast."""

from __future__ import annotations

import logging
import shlex
import signal
import sys
from dataclasses import dataclass

import click

from gqakit import __version__
from gqakit.console import quiet_transformers
from gqakit.names import resolve
from gqakit.storage import CREATED, remove_new_empty


@dataclass(frozen=True)
class CommandEntry:
    """One ``gqakit`` subcommand: the module that holds its click command (``gqakit.MODULE``, imported when
    the command runs; the command is its ``NAME_cmd``), the line ``gqakit --help`` shows for it, and how
    an interrupted run goes on: ``"rerun"`` (the same command reuses what was done), ``"--resume"`` (the
    same command with that flag), or ``None`` (nothing is kept: the same command starts over)."""

    module: str
    summary: str
    resume: str | None = "rerun"


COMMANDS: dict[str, CommandEntry] = {
    "inspect": CommandEntry(
        "convert.cli", "Show a checkpoint's attention geometry and KV-cache bytes per G.", None
    ),
    "convert": CommandEntry(
        "convert.cli", "Convert a checkpoint (directory, .gguf or hub id) to G K/V heads."
    ),
    "expand": CommandEntry("convert.cli", "GQA/MQA -> MHA, exactly the same logits.", None),
    "export": CommandEntry("gguf.cli", "Write a checkpoint as a GGUF file for llama.cpp.", None),
    "probe": CommandEntry("pipelines.probe.run", "Zero-training quality of each G x method."),
    "eval": CommandEntry(
        "eval.cli", "Perplexity, lm-eval tasks, decode speed and KV memory, side by side.", None
    ),
    "uptrain": CommandEntry("uptrain.cli", "Uptrain a (converted) model as a YAML recipe says.", "--resume"),
    "assets": CommandEntry("assets", "Fetch and list the offline assets (model, corpus).", None),
    "demo": CommandEntry("pipelines.demo.run", "SmolLM2-135M to MHA, GQA and MQA, uptrained and measured."),
    "replicate": CommandEntry(
        "pipelines.replicate.run", "Re-run the GQA paper's experiments on a model trained here."
    ),
    "recovery": CommandEntry(
        "pipelines.recovery.run", "Uptraining tokens each start needs to reach the original's quality."
    ),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are listed from :data:`COMMANDS` and imported when they run, so
    ``gqakit --help`` imports none of them (no torch); a command whose module fails to import fails
    loudly when it is run, and still shows in the list."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return load_command(name) if name in COMMANDS else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name].summary) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args: list[str] | None = None, *rest: object, **kwargs: object) -> object:
        self.argv = list(sys.argv[1:] if args is None else args)  # for the resume line below
        return super().main(args, *rest, **kwargs)

    def invoke(self, ctx: click.Context) -> object:
        argv = getattr(self, "argv", [])
        if not {"-h", "--help", "-v", "--verbose"} & set(argv) and ctx.invoked_subcommand:
            # One line per step: libraries' warnings and progress bars only under --verbose. The
            # command imports transformers anyway, so this costs nothing; --help imports none of it.
            quiet_transformers()
        CREATED.clear()
        try:
            return super().invoke(ctx)
        except BaseException as e:
            # a refusal (or Ctrl-C) leaves no folder behind: those this command made and did not fill go
            if getattr(e, "exit_code", getattr(e, "code", 1)) not in (0, None):
                remove_new_empty()
            if isinstance(e, KeyboardInterrupt):
                # click would print "Aborted!" and exit 1; say instead which command goes on from here
                click.echo(interrupted_message(ctx.invoked_subcommand, argv), err=True)
                ctx.exit(130)
            raise


def interrupted_message(name: str | None, argv: list[str]) -> str:
    """What ``gqakit NAME ARGV...`` says when Ctrl-C stops it: the command that goes on from there."""
    entry = COMMANDS.get(name or "")
    again = ["gqakit", *argv]
    if entry is None or entry.resume is None:
        return f"Interrupted; what was not finished is not kept. Run it again: {shlex.join(again)}"
    if entry.resume == "rerun":
        return f"Interrupted. Run the same command to resume from what is done: {shlex.join(again)}"
    if entry.resume not in argv:
        again.append(entry.resume)
    return f"Interrupted. Resume with: {shlex.join(again)}"


def load_command(name: str) -> click.Command:
    """The click command of ``gqakit NAME`` (its module imported now)."""
    return resolve(f"gqakit.{COMMANDS[name].module}:{name}_cmd")


def _terminate(signum: int, frame: object) -> None:
    # Turn SIGTERM into an exception so atomic writers clean up their temporary directories.
    raise SystemExit(128 + signum)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gqakit")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
def main(verbose: bool) -> None:
    """Convert MHA checkpoints to GQA/MQA, uptrain them, and measure the result."""
    # One line per step: messages plain; --verbose adds debug messages with their times and sources.
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s: %(message)s" if verbose else "%(message)s",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGTERM, _terminate)
