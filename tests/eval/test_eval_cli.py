"""`gqakit eval` through click's CliRunner: a full run, and one clear message per bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gqakit.cli import main


def _run(*args: str):
    return CliRunner().invoke(main, ["eval", *args], catch_exceptions=False)


def test_cli_writes_the_report(tiny_models, known_txt, tmp_path):
    out = tmp_path / "report"
    result = _run(
        str(tiny_models["mqa"]),
        "--baseline",
        str(tiny_models["mha"]),
        "--ppl-data",
        str(known_txt),
        "--seq-len",
        "32",
        "--set",
        "stride=16",
        "--bench",
        "--batch-sizes",
        "1,2",
        "--contexts",
        "8,16",
        "--new-tokens",
        "3",
        "--set",
        "warmup=0",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--no-progress",
    )
    assert result.exit_code == 0, result.output
    assert "| **mha** (baseline) | 4/4 |" in result.output
    assert "| mqa | 1/4 |" in result.output
    # the printed table is report.md's, rendered from the results (not read back from the file)
    printed = result.output.split("\n\nWrote ")[0].strip().splitlines()
    table = [line.split("\r")[-1] for line in printed if line.split("\r")[-1].startswith("|")]
    assert len(table) == 4 and "\n".join(table) in (out / "report.md").read_text()
    assert {p.name for p in out.iterdir()} == {
        "report.md",
        "results.json",
        "decode_tokens_per_s.png",
        "kv_cache_mib.png",
        "perplexity.png",
    }
    res = json.loads((out / "results.json").read_text())
    assert res["options"]["stride"] == 16 and res["baseline"] == "mha"
    assert res["environment"]["command_line"].split()[0] == "gqakit"


@pytest.fixture
def not_causal(tmp_path):
    from transformers import AutoConfig

    path = tmp_path / "vit"
    AutoConfig.for_model("vit").save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_model", "does not exist"),
        ("not_causal", "is a 'vit' model, not a causal language model"),
        ("missing_data", "--ppl-data {tmp}/nope.txt does not exist"),
        ("empty_data", "holds no text"),
        ("no_field", "has no field 'text'; its fields are body"),
        ("seq_len", "--seq-len 512 is more than this model's 256 positions"),
        ("contexts_too_long", "--contexts 300 plus --new-tokens 32 is more than the 256 positions"),
        ("bad_grid", "--batch-sizes '1,two' is not a comma-separated list"),
        ("zero_grid", "--contexts '0,16' has non-positive values"),
        ("unknown_task", "'helaswag'. Did you mean \"hellaswag\"?"),
        ("nothing", "Nothing to evaluate"),
        ("bad_lm_eval_args", "'num_fewshots' is not an lm-eval option"),
    ],
)
def test_bad_input(case, message, tiny_models, tmp_path, not_causal):
    model = str(tiny_models["gqa"])
    txt = tmp_path / "t.txt"
    txt.write_text("Some text to score. " * 10)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "x"}\n')
    args = {
        "missing_model": [str(tmp_path / "no-model"), "--ppl-data", str(txt), "--seq-len", "64"],
        "not_causal": [str(not_causal), "--ppl-data", str(txt), "--seq-len", "64"],
        "missing_data": [model, "--ppl-data", str(tmp_path / "nope.txt"), "--seq-len", "64"],
        "empty_data": [model, "--ppl-data", str(empty), "--seq-len", "64"],
        "no_field": [model, "--ppl-data", str(rows), "--seq-len", "64"],
        "seq_len": [model, "--ppl-data", str(txt), "--seq-len", "512"],
        "contexts_too_long": [model, "--bench", "--contexts", "16,300"],
        "bad_grid": [model, "--bench", "--batch-sizes", "1,two"],
        "zero_grid": [model, "--bench", "--contexts", "0,16"],
        "unknown_task": [model, "--tasks", "helaswag", "--seq-len", "64"],
        "nothing": [model],
        "bad_lm_eval_args": [
            model,
            "--tasks",
            "gqakit_mc",
            "--lm-eval-args",
            "--num_fewshots 2",
            "--seq-len",
            "64",
        ],
    }[case]
    result = _run(*args, "--device", "cpu", "--out", str(tmp_path / "out"), "--no-progress")
    assert result.exit_code != 0
    assert message.format(tmp=tmp_path) in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out" / "report.md").exists()


def test_model_data_and_task_problems_are_reported_together(tiny_models, tmp_path):
    result = _run(
        str(tmp_path / "no-model"),
        "--baseline",
        str(tiny_models["gqa"]),
        "--ppl-data",
        str(tmp_path / "nope.txt"),
        "--tasks",
        "gqakit_mcc",
        "--out",
        str(tmp_path),
    )
    assert result.exit_code != 0
    for part in ("[no-model] Model path", "[gqa] --seq-len 512", "nope.txt does not exist", "'gqakit_mcc'"):
        assert part in result.output


def test_several_problems_are_reported_together(tiny_models, tmp_path):
    result = _run(
        str(tiny_models["gqa"]),
        "--bench",
        "--batch-sizes",
        "1,1",
        "--contexts",
        "0",
        "--seq-len",
        "0",
        "--out",
        str(tmp_path),
    )
    assert result.exit_code != 0
    for part in ("--batch-sizes", "--contexts", "--seq-len must be at least 1"):
        assert part in result.output


def test_help_lists_at_most_20_options_and_every_knob_of_set():
    import click

    from gqakit.cli import load_command
    from gqakit.cli_options import settable
    from gqakit.eval.options import EvalOptions

    command = load_command("eval")
    options = [p for p in command.get_params(click.Context(command)) if isinstance(p, click.Option)]
    assert len(options) <= 20  # --help counted
    text = CliRunner().invoke(main, ["eval", "--help"]).output
    assert all(name in text for name in settable(EvalOptions)) and "--stride" not in text


@pytest.mark.parametrize(
    "setting, message",
    [
        ("strid=4", "'strid' is no setting. Did you mean \"stride\"?"),
        ("stride", "--set 'stride' is not NAME=VALUE"),
        ("warmup=two", "warmup takes a whole number, got 'two'"),
        ("static_cache=maybe", "static_cache takes true or false"),
        ("stride=0", "--set stride must be between 1 and --seq-len 512, got 0."),
    ],
)
def test_a_bad_setting_is_named(setting, message, tiny_models, tmp_path):
    result = _run(str(tiny_models["gqa"]), "--bench", "--set", setting, "--out", str(tmp_path))
    assert result.exit_code != 0 and message in result.output


def test_settings_are_read_as_their_fields_types():
    from gqakit.cli_options import parse_set
    from gqakit.eval.options import EvalOptions

    pairs = ["stride=256", "static-cache=yes", "data_config=none", "gpu_memory_utilization=0.5"]
    assert parse_set(EvalOptions, pairs) == {
        "stride": 256, "static_cache": True, "data_config": None, "gpu_memory_utilization": 0.5
    }  # fmt: skip
