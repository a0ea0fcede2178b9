"""Uptraining refuses what would run wrong, before any model loads: one clear message per case, and runs
record what actually ran. One row per message; add a row with every new one."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from gqakit.errors import GqakitError
from gqakit.uptrain.api import uptrain
from gqakit.uptrain.loop import UptrainLoop
from gqakit.uptrain.metrics import read_history


def _bert(root: Path) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=384, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64)  # fmt: skip
    BertForMaskedLM(cfg).save_pretrained(root / "bert")
    return root / "bert"


def _file(root: Path, name: str, data: bytes) -> Path:
    (root / name).write_bytes(data)
    return root / name


# (id, overrides built from the test's tmp_path, message fragment)
CASES = [
    ("seq-len-beyond-positions", lambda t: ["data.seq_len=4096"],
     "data.seq_len 4096 is more than the 256 positions"),
    ("teacher-is-an-encoder", lambda t: [f"teacher={_bert(t)}", "objective.kind=distill"],
     "teacher: The teacher"),
    ("empty-data-file", lambda t: [f"data.files=[{_file(t, 'empty.txt', b'')}]"],
     "holds no text"),
    ("binary-data-file", lambda t: [f"data.files=[{_file(t, 'bin.txt', bytes(range(256)) * 8)}]"],
     "is not UTF-8 text"),
    ("fp16-on-a-cpu", lambda t: ["train.precision=fp16"],
     "train.precision=fp16 needs a CUDA GPU"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_message(recipe, tmp_path, overrides, message):
    with pytest.raises(GqakitError, match=message):
        uptrain(recipe(*overrides(tmp_path)))


def test_an_unwritable_output_dir_is_one_message(recipe):
    probe = Path("/sys/gqakit-write-probe")
    try:
        probe.mkdir()
        probe.rmdir()
        pytest.skip("no unwritable directory available")
    except OSError:
        pass
    with pytest.raises(GqakitError, match="output_dir /sys/run cannot be written"):
        uptrain(recipe("output_dir=/sys/run"))


def test_resume_with_a_changed_recipe_names_the_keys(recipe, tmp_path, monkeypatch):
    common = ("budget.steps=4", "checkpoint.every=2")
    r = recipe(*common)

    class Killed(Exception):
        pass

    log_train = UptrainLoop._log_train

    def die(self, *a, **k):
        log_train(self, *a, **k)
        if self.state.step == 3:
            raise Killed

    monkeypatch.setattr(UptrainLoop, "_log_train", die)
    with pytest.raises(Killed):
        uptrain(r)
    monkeypatch.setattr(UptrainLoop, "_log_train", log_train)
    changed = recipe(*common, "train.lr=1e-2", "data.seq_len=16")
    with pytest.raises(GqakitError, match=r"data.seq_len \(32 -> 16\), train.lr") as e:
        uptrain(changed, resume=True)
    assert "only budget.steps/tokens/alpha" in e.value.message
    longer = recipe("budget.steps=5", "checkpoint.every=2", "log.every=1")  # a safe change: more steps
    res = uptrain(longer, resume=True)
    assert res.steps == 5
    assert [h["step"] for h in read_history(res.output_dir) if "loss" in h] == [1, 2, 3, 4, 5]


def test_a_run_killed_before_its_first_checkpoint_does_not_duplicate_its_records(recipe, monkeypatch):
    r = recipe("budget.steps=3", "checkpoint.every=0", "model.convert.groups=2")

    class Killed(Exception):
        pass

    log_train = UptrainLoop._log_train

    def die(self, *a, **k):
        log_train(self, *a, **k)
        if self.state.step == 2:
            raise Killed

    monkeypatch.setattr(UptrainLoop, "_log_train", die)
    with pytest.raises(Killed):
        uptrain(r)  # its conversion is kept for --resume; its two logged steps too
    monkeypatch.setattr(UptrainLoop, "_log_train", log_train)
    res = uptrain(r, resume=True)
    assert [h["step"] for h in read_history(res.output_dir) if "loss" in h] == [1, 2, 3]


def test_the_precision_that_ran_is_recorded(recipe):
    res = uptrain(recipe("budget.steps=1", "train.precision=bf16"))
    prov = json.loads((res.output_dir / "gqakit.json").read_text())
    assert prov["precision"] == "bf16"  # a CPU runs bf16 through autocast


def test_other_ranks_log_warnings_only(recipe, monkeypatch):
    import gqakit.uptrain.api as api

    class Rank1:
        is_main_process = False

        def wait_for_everyone(self) -> None:
            pass

    monkeypatch.setattr(api, "process_state", lambda: Rank1())
    logger = logging.getLogger("gqakit")
    before = logger.level
    try:
        with pytest.raises(GqakitError):  # stops at its inputs; the logging is set by then
            uptrain(recipe("data.files=[/nonexistent.txt]"))
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize(
    ("name", "ip", "message"),
    [
        ("deepspeed-zero3.yaml", None, "needs DeepSpeed, which is not installed: pip install deepspeed"),
        ("multi-node.yaml", None, "main_process_ip is '10.0.0.1', the shipped placeholder"),
    ],
)
def test_shipped_accelerate_configs_fail_fast_with_the_fix(name, ip, message, monkeypatch):
    import importlib.util

    from click.testing import CliRunner

    from gqakit.cli import main
    from gqakit.uptrain.recipe import RECIPES_DIR

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a))
    monkeypatch.setattr(os, "execvp", lambda *a: pytest.fail("launched despite the problem"))
    config = str(RECIPES_DIR / "accelerate" / name)
    res = CliRunner().invoke(main, ["uptrain", "tiny", "--accelerate-config", config])
    assert res.exit_code != 0 and message in res.output, res.output


def test_a_valid_multi_node_launch_runs_accelerate_with_the_address(monkeypatch):
    from click.testing import CliRunner

    from gqakit.cli import main
    from gqakit.uptrain.recipe import RECIPES_DIR

    seen = []
    monkeypatch.setattr(os, "execvp", lambda prog, argv: seen.append(argv))
    config = str(RECIPES_DIR / "accelerate" / "multi-node.yaml")
    args = ["uptrain", "tiny", "train.lr=1e-4", "--accelerate-config", config, "--machine-rank", "1"]
    res = CliRunner().invoke(main, [*args, "--main-process-ip", "192.0.2.7", "--resume"])
    assert res.exit_code == 0, res.output
    assert seen == [
        ["accelerate", "launch", "--config_file", config, "--machine_rank", "1", "--main_process_ip",
         "192.0.2.7", "-m", "gqakit.uptrain", "tiny", "train.lr=1e-4", "--resume"]
    ]  # fmt: skip
