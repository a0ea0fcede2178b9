"""The pipelines' command lines: each within the option count the issue caps (counting --help), every flag
generated from its options dataclass, and ``--set`` passing recipe and conversion settings through."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gqakit.cli import main
from gqakit.errors import GqakitError
from gqakit.pipelines.demo import DemoOptions
from gqakit.pipelines.recovery import RecoveryOptions
from gqakit.pipelines.replicate import ReplicateOptions
from gqakit.problems import check_options

CAPS = {"recovery": 16, "demo": 12, "replicate": 12, "probe": 10}


def _options(command: str) -> list[str]:
    """The long flags of the options ``gqakit COMMAND --help`` lists, one per option (``--help`` too)."""
    res = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    lines = res.output.split("Options:")[1].splitlines()
    return [
        next(t.rstrip(",") for t in ln.split() if t.startswith("--")) for ln in lines if ln.startswith("  -")
    ]


@pytest.mark.parametrize("command", sorted(CAPS))
def test_each_pipeline_lists_at_most_its_cap_of_options(command):
    options = _options(command)
    assert "--help" in options
    assert len(options) <= CAPS[command], options


def test_the_flags_are_the_options_fields():
    recovery = _options("recovery")
    assert {"--groups", "--starts", "--tokens", "--lr", "--set", "--work-dir"} <= set(recovery)
    assert "--start-lr" not in recovery
    for gone in ("--refine-steps", "--refine-target", "--calib-tokens", "--seq-len", "--objective"):
        assert gone not in recovery  # given as --set model.convert.* / recipe keys instead
    assert {"--budget-scale", "--eval-tokens", "--decode-rounds", "--set", "--out"} <= set(_options("demo"))
    assert {"--scale", "--alphas", "--starts", "--set", "--pretrain-only"} <= set(_options("replicate"))
    assert {"--groups", "--methods", "--eval-data", "--calib-data"} <= set(_options("probe"))
    assert "--grouping" not in _options("probe")


def test_defaults_come_from_the_dataclasses():
    help_text = " ".join(CliRunner().invoke(main, ["recovery", "--help"]).output.split())
    assert f"[default: {','.join(RecoveryOptions.__dataclass_fields__['starts'].default)}]" in help_text
    assert DemoOptions().out.name == "demo-report" and ReplicateOptions().work_dir.name == "replicate-work"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (DemoOptions(sets=("model.convert.method=first",)), "--set 'model.convert.method=first'"),
        (ReplicateOptions(sets=("model.convert.groups=2",)), "--set 'model.convert.groups=2'"),
    ],
)
def test_set_refuses_a_conversion_field_the_start_owns(options, message):
    with pytest.raises(GqakitError, match=message):
        check_options(options)


def test_recovery_reads_the_block_size_and_batch_from_set():
    o = RecoveryOptions(src="x", groups=1, tokens=4096, sets=("data.seq_len=32", "train.batch_size=8"))
    assert o.tokens_per_step == 256 and o.steps == 16
    assert RecoveryOptions(src="x", groups=1).tokens_per_step == 1024  # 4 blocks of 256 tokens
