"""The ``gqakit`` command table: ``--help`` lists every command without importing any of them (or
torch), and a command whose module is broken fails loudly when it runs instead of vanishing."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from gqakit.cli import COMMANDS, CommandEntry, load_command, main

HELP_WITHOUT_TORCH = """
import sys
from gqakit.cli import main
try:
    main(["--help"])
except SystemExit as e:
    assert e.code == 0, e.code
heavy = sorted(m for m in ("torch", "transformers", "gqakit.convert", "gqakit.eval") if m in sys.modules)
print("IMPORTED", heavy)
"""


def test_help_lists_every_command_without_importing_torch():
    out = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT_TORCH], capture_output=True, text=True, check=True
    )
    assert "IMPORTED []" in out.stdout, out.stdout + out.stderr
    listing = " ".join(out.stdout.split())  # help wraps long lines
    for name, entry in COMMANDS.items():
        assert f"{name} {entry.summary}" in listing


def test_every_table_entry_is_the_command_it_names():
    for name in COMMANDS:
        command = load_command(name)
        assert isinstance(command, click.Command) and command.name == name


def test_a_command_whose_module_is_broken_fails_loudly_and_stays_listed(monkeypatch):
    monkeypatch.setitem(COMMANDS, "convert", CommandEntry("no_such_module", "Convert."))
    listing = CliRunner().invoke(main, ["--help"])
    assert listing.exit_code == 0 and "convert" in listing.output
    res = CliRunner().invoke(main, ["convert", "--help"])
    assert res.exit_code != 0 and isinstance(res.exception, ModuleNotFoundError)
    with pytest.raises(ModuleNotFoundError, match="gqakit.no_such_module"):
        load_command("convert")


@pytest.mark.parametrize("fails", [True, False])
def test_a_refused_command_leaves_no_empty_folder_it_made(monkeypatch, tmp_path, fails):
    """Folders made through storage.make_dirs by a command that then fails go if still empty; a folder
    that holds something, and every folder of a command that succeeds, stay."""
    import gqakit.cli
    from gqakit.errors import GqakitError
    from gqakit.storage import make_dirs

    @click.command("convert")
    def command() -> None:
        make_dirs(tmp_path / "new" / "nested")
        (make_dirs(tmp_path / "filled") / "f").write_text("x")
        if fails:
            raise GqakitError("refused")

    monkeypatch.setattr(gqakit.cli, "load_command", lambda name: command)
    res = CliRunner().invoke(main, ["convert"])
    assert res.exit_code == (2 if fails else 0), res.output
    assert (tmp_path / "new").exists() is not fails
    assert (tmp_path / "filled" / "f").is_file()
