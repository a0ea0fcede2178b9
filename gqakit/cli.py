"""The ``gqakit`` command. Subcommands are imported only when invoked, so ``--help`` stays fast."""

from __future__ import annotations

import importlib
import logging
import signal
import sys

import click

from gqakit import __version__

# name -> "module:attribute" of a click command
COMMANDS: dict[str, str] = {
    "inspect": "gqakit.convert.cli:inspect_cmd",
    "convert": "gqakit.convert.cli:convert_cmd",
    "expand": "gqakit.convert.cli:expand_cmd",
    "export": "gqakit.gguf.cli:export_cmd",
    "probe": "gqakit.pipelines.probe.cli:probe_cmd",
    "eval": "gqakit.eval.cli:eval_cmd",
    "uptrain": "gqakit.uptrain.cli:uptrain_cmd",
    "assets": "gqakit.assets_cli:assets_cmd",
    "demo": "gqakit.pipelines.demo.cli:demo_cmd",
    "replicate": "gqakit.pipelines.replicate.cli:replicate_cmd",
}


class LazyGroup(click.Group):
    """A click group that imports each subcommand's module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(n for n in COMMANDS if self._load(n, quiet=True) is not None)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load(name) if name in COMMANDS else None

    @staticmethod
    def _load(name: str, quiet: bool = False) -> click.Command | None:
        try:
            return load_command(name)
        except (ImportError, AttributeError):
            if quiet:
                return None
            raise


def load_command(name: str) -> click.Command:
    """The click command of ``gqakit NAME`` (its module imported now)."""
    module, attr = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def _terminate(signum: int, frame: object) -> None:
    # Turn SIGTERM into an exception so atomic writers clean up their temporary directories.
    raise SystemExit(128 + signum)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gqakit")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
def main(verbose: bool) -> None:
    """Convert MHA checkpoints to GQA/MQA, uptrain them, and measure the result."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGTERM, _terminate)


if __name__ == "__main__":
    main()
