"""The convert, expand and inspect commands through click, as a user types them."""

from __future__ import annotations

import json

from click.testing import CliRunner
from tiny_models import save_tiny_model

from gqakit.cli import main


def test_convert_expand_inspect_round_trip(tmp_path):
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=2)
    runner = CliRunner()

    res = runner.invoke(main, ["inspect", str(src)])
    assert res.exit_code == 0, res.output
    assert "K/V heads         2  (GQA)" in res.output and "G=1" in res.output

    res = runner.invoke(main, ["expand", str(src), str(tmp_path / "mha")])
    assert res.exit_code == 0, res.output
    assert "K/V heads 2 -> 4" in res.output

    res = runner.invoke(
        main,
        ["convert", str(tmp_path / "mha"), str(tmp_path / "mqa"), "--groups", "1", "--dtype", "bfloat16"],
    )
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "mqa" / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 1 and cfg["dtype"] == "bfloat16"

    res = runner.invoke(main, ["inspect", str(tmp_path / "mqa"), "--json"])
    assert json.loads(res.output)["num_kv_heads"] == 1


def test_bad_choice_is_rejected_by_click(tiny_llama, tmp_path):
    res = CliRunner().invoke(
        main, ["convert", str(tiny_llama), str(tmp_path / "o"), "-g", "1", "--method", "median"]
    )
    assert res.exit_code == 2 and "median" in res.output


def test_help_lists_commands():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    for cmd in ("convert", "expand", "inspect"):
        assert cmd in res.output
