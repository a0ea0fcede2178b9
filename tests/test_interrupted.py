"""The ``gqakit`` group itself: what an interrupted command says and its exit status."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from gqakit import cli


@pytest.mark.parametrize(
    "resume, args, said",
    [
        (
            "rerun",
            ["x", "--out", "a b"],
            "Run the same command to resume from what is done: gqakit x --out 'a b'",
        ),
        ("--resume", ["x", "r.yaml"], "Resume with: gqakit x r.yaml --resume"),
        (None, ["x"], "what was not finished is not kept. Run it again: gqakit x"),
    ],
)
def test_ctrl_c_names_the_command_that_goes_on_and_exits_130(monkeypatch, resume, args, said):
    @click.command()
    @click.option("--out", default=None)
    @click.argument("recipe", required=False)
    def stopped(out: str | None, recipe: str | None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "x", cli.CommandEntry("unused", "a test command", resume))
    real = cli.load_command
    monkeypatch.setattr(cli, "load_command", lambda name: stopped if name == "x" else real(name))
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 130
    assert said in result.output
    assert "Aborted" not in result.output


def test_every_command_says_how_it_resumes():
    assert {e.resume for e in cli.COMMANDS.values()} <= {"rerun", "--resume", None}
    assert cli.COMMANDS["uptrain"].resume == "--resume"
