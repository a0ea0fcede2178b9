"""Uptraining refuses what would run wrong, before any model loads: one clear message per case, and runs
record what actually ran. One row per message; add a row with every new one."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from die_after_step import kill_after

from gqakit.errors import GqakitError
from gqakit.uptrain import read_history, setup, train
from gqakit.uptrain.train import uptrain


def _bert(root: Path) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=384, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64)  # fmt: skip
    BertForMaskedLM(cfg).save_pretrained(root / "bert")
    return root / "bert"


def _file(root: Path, name: str, data: bytes) -> Path:
    (root / name).write_bytes(data)
    return root / name


def _data(root: Path, name: str, content: bytes, key: str = "data.files") -> str:
    """The override ``key=[FILE]`` for a new data file ``name`` holding ``content``."""
    return f"{key}=[{_file(root, name, content)}]"


BINARY = bytes(range(256)) * 8
MALFORMED_JSONL = b'{"text": "a b"}\n{oops\n'
OTHER_FIELD_JSONL = b'{"body": "a b"}\n'

# (id, overrides built from the test's tmp_path, message fragment). Each is refused before any model
# loads or conversion starts.
CASES = [
    ("seq-len-beyond-positions", lambda t: ["data.seq_len=4096"],
     "model.path: data.seq_len 4096 is more than this model's 256 positions"),
    ("teacher-is-an-encoder", lambda t: [f"teacher={_bert(t)}", "objective.kind=distill"],
     "teacher: The teacher .* is a 'bert' checkpoint"),
    ("model-is-an-encoder", lambda t: [f"model.path={_bert(t)}", "model.convert=null"],
     "model.path: The model .* is a 'bert' checkpoint"),
    ("empty-data-file", lambda t: [_data(t, "empty.txt", b"")],
     "data.files .*empty.txt holds no text"),
    ("blank-data-file", lambda t: [_data(t, "blank.txt", b"  \n\n")],
     "data.files .*blank.txt holds no text"),
    ("binary-data-file", lambda t: [_data(t, "bin.txt", BINARY)],
     "data.files .*bin.txt is not UTF-8 text"),
    ("binary-val-file", lambda t: [_data(t, "vbin.txt", BINARY, "data.val_files")],
     "data.val_files .*vbin.txt is not UTF-8 text"),
    ("malformed-jsonl", lambda t: [_data(t, "bad.jsonl", MALFORMED_JSONL)],
     "data.files .*bad.jsonl could not be loaded"),
    ("jsonl-without-the-text-field", lambda t: [_data(t, "f.jsonl", OTHER_FIELD_JSONL)],
     "has no field 'text'; its fields are body"),
    ("mixed-file-types", lambda t: [f"data.files=[{_file(t, 'a.txt', b'x y')}, {_file(t, 'b.jsonl', b'')}]"],
     "data.files mixes file types"),
    ("fp16-is-gone", lambda t: ["train.precision=fp16"],
     "train.precision: 'fp16' is not allowed. .*Choose one of auto, bf16, fp32"),
    ("output-dir-is-a-file", lambda t: [f"output_dir={_file(t, 'out', b'x')}"],
     "output_dir .*out is a file"),
    ("checkpoint-keep-0", lambda t: ["checkpoint.keep=0"],
     r"checkpoint.keep must be at least 1 \(.*rollback .* set checkpoint.every=0\), got 0"),
    ("val-split-with-files", lambda t: ["data.val_split=validation"],
     "data.val_split='validation' only applies to data.hub; with data.files set data.val_split=null"),
    ("val-fraction-0-beside-val-split", lambda t: ["data.val_split=validation", "data.val_fraction=0"],
     r"data.val_fraction must be between 0 and 1 \(exclusive\), got 0"),
]  # fmt: skip


def _forbid_work(monkeypatch) -> None:
    """Fail the test if the run gets as far as converting or loading a model."""

    def fail(*a, **k):
        pytest.fail("validation came after the expensive part")

    monkeypatch.setattr(train, "convert_first", fail)
    monkeypatch.setattr(setup, "load_student", fail)


@pytest.fixture
def no_work(monkeypatch):
    _forbid_work(monkeypatch)


@pytest.mark.parametrize(("overrides", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_message_before_any_work(recipe, tmp_path, no_work, overrides, message):
    with pytest.raises(GqakitError, match=message):
        uptrain(recipe(*overrides(tmp_path)))


def test_every_problem_is_reported_together(recipe, tmp_path, no_work):
    empty = _file(tmp_path, "empty.txt", b"")
    r = recipe("data.seq_len=4096", f"data.files=[{empty}]", f"output_dir={_file(tmp_path, 'out', b'x')}")
    with pytest.raises(GqakitError) as e:
        uptrain(r)
    lines = e.value.message.splitlines()
    assert lines[0] == "The recipe's inputs have problems:"
    assert len([ln for ln in lines if ln.startswith("  - ")]) == 3, e.value.message


def test_what_the_machine_cannot_run_is_refused(recipe):
    from gqakit.uptrain.preflight import environment_problems

    assert environment_problems(recipe(), "NO", "cpu") == []
    # DeepSpeed is retired: a direct `accelerate launch` of a DeepSpeed config is refused with the way on
    (problem,) = environment_problems(recipe(), "DEEPSPEED", "cuda")
    assert "DEEPSPEED is not supported: FSDP2 shards" in problem and "fsdp-cpu.yaml" in problem


def test_a_run_directory_another_run_holds_is_refused_before_any_work(recipe, tmp_path, no_work):
    from gqakit.uptrain.setup import run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("the other run's\n")
    with run_dir(run, True, False, lambda: None):  # as a run under way holds it
        for flags in ({}, {"resume": True}, {"force": True}):
            with pytest.raises(GqakitError, match=r"output_dir .*run is in use by another run \(pid \d+ "):
                uptrain(recipe(), **flags)
    assert (run / "recipe.yaml").read_text() == "the other run's\n"  # --force deleted nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # the lock is gone with its holder


def test_a_refused_recipe_leaves_no_parent_directory_behind(recipe, tmp_path, no_work):
    with pytest.raises(GqakitError, match="nonexistent.txt"):
        uptrain(recipe("data.files=[/nonexistent.txt]", f"output_dir={tmp_path / 'a' / 'b' / 'run'}"))
    assert not (tmp_path / "a").exists()


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


def _kill_at(step: int, r, monkeypatch) -> None:
    """Run ``r`` and stop it right after step ``step`` is logged (a kill)."""
    kill_after(step, lambda: uptrain(r), monkeypatch)


def test_resume_with_a_changed_recipe_or_world_names_what_differs(recipe, tmp_path, monkeypatch):
    common = ("budget.steps=4", "checkpoint.every=2")
    _kill_at(3, recipe(*common), monkeypatch)
    _forbid_work(monkeypatch)  # every refusal below comes before any model loads
    changed = recipe(*common, "train.lr=1e-2", "data.seq_len=16")
    with pytest.raises(GqakitError, match=r"data.seq_len \(32 -> 16\), train.lr") as e:
        uptrain(changed, resume=True)
    assert "only budget.steps, budget.tokens, budget.alpha, eval.*, " in e.value.message
    with pytest.raises(GqakitError, match="budget is 1 steps but the checkpoint step-00000002 has already"):
        uptrain(recipe("budget.steps=1", "checkpoint.every=2"), resume=True)
    state_file = tmp_path / "run" / "checkpoints" / "step-00000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["processes"] == 1
    state_file.write_text(json.dumps({**state, "processes": 2}))
    with pytest.raises(GqakitError, match="written by 2 process.* this run has 1: .* --num_processes 2"):
        uptrain(recipe(*common), resume=True)


def test_resume_with_a_longer_budget_goes_on_and_drops_a_torn_record(recipe, tmp_path, monkeypatch):
    _kill_at(3, recipe("budget.steps=4", "checkpoint.every=2"), monkeypatch)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "loss": 1.2')  # a kill in the middle of writing a record
    longer = recipe("budget.steps=5", "checkpoint.every=2", "log.every=1")  # a safe change: more steps
    res = uptrain(longer, resume=True)
    assert res.steps == 5
    assert [h["step"] for h in read_history(res.output_dir) if "loss" in h] == [1, 2, 3, 4, 5]


def test_a_run_killed_before_its_first_checkpoint_does_not_duplicate_its_records(recipe, monkeypatch):
    r = recipe("budget.steps=3", "checkpoint.every=0", "model.convert.groups=2")
    _kill_at(2, r, monkeypatch)  # its conversion is kept for --resume; its two logged steps too
    res = uptrain(r, resume=True)
    assert [h["step"] for h in read_history(res.output_dir) if "loss" in h] == [1, 2, 3]


def test_the_precision_that_ran_is_recorded(recipe):
    res = uptrain(recipe("budget.steps=1", "train.precision=bf16"))
    prov = json.loads((res.output_dir / "gqakit.json").read_text())
    assert prov["precision"] == "bf16"  # a CPU runs bf16 through autocast


def test_a_recipe_takes_auto_precision_and_records_what_ran(recipe):
    from gqakit.uptrain.preflight import resolve_precision

    res = uptrain(recipe("budget.steps=1", "train.precision=auto"))
    prov = json.loads((res.output_dir / "gqakit.json").read_text())
    assert prov["precision"] == resolve_precision("auto", "cpu") != "auto"
    with pytest.raises(GqakitError, match="train.precision"):
        recipe("train.precision=bf32")


def test_auto_precision_follows_the_device_asked_for(monkeypatch):
    import torch

    from gqakit.uptrain.preflight import resolve_precision

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # a bf16 CPU
    assert resolve_precision("auto", "cpu") == "bf16" and resolve_precision("fp32", "cpu") == "fp32"
    # and a GPU without bfloat16: it decides for --device auto, not for --device cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision("auto", "auto") == "fp32"
    assert resolve_precision("auto", "cpu") == "bf16"


def test_other_ranks_log_errors_only_and_show_no_progress_bars(recipe, monkeypatch):
    import datasets
    import transformers

    class Rank1:
        is_main_process = False
        num_processes = 1  # a fake without a process group: no collective calls

        def wait_for_everyone(self) -> None:
            pass

    monkeypatch.setattr(train, "process_state", lambda: Rank1())
    logger = logging.getLogger("gqakit")
    before = logger.level
    try:
        with pytest.raises(GqakitError):  # stops at its inputs; the logging is set by then
            uptrain(recipe("data.files=[/nonexistent.txt]"))
        assert logger.level == logging.ERROR
        assert not datasets.is_progress_bar_enabled()
        assert transformers.utils.logging.is_progress_bar_enabled() is False
        logger.setLevel(before)
        with pytest.raises(GqakitError):  # asked for: every rank logs
            uptrain(recipe("data.files=[/nonexistent.txt]", "log.all_ranks=true"))
        assert logger.level == before
    finally:
        logger.setLevel(before)
        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("deepspeed.yaml", "DEEPSPEED is not supported: FSDP2 shards parameters, gradients and optimizer"),
        ("multi-node.yaml", "main_process_ip is '10.0.0.1', the shipped placeholder"),
        # without GPUs accelerate would start 8 independent single-process runs
        ("fsdp.yaml", "fsdp.yaml: distributed_type FSDP with num_processes 8 puts each process on a "
         "GPU, and this machine has no GPU: accelerate would start each process as an independent "
         "single-process run"),
        ("fsdp.yaml", "Without GPUs use recipes/accelerate/fsdp-cpu.yaml (FSDP2 over 2 CPU processes"),
        ("ddp.yaml", "distributed_type MULTI_GPU with num_processes 8 puts each process on a GPU"),
    ],
)  # fmt: skip
def test_shipped_accelerate_configs_fail_fast_with_the_fix(name, message, monkeypatch, tmp_path):
    import torch
    from click.testing import CliRunner

    from gqakit.cli import main
    from gqakit.uptrain.recipe import RECIPES_DIR

    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("launched despite the problem"))
    monkeypatch.setattr(os, "execvp", lambda *a: pytest.fail("launched despite the problem"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # this machine, as CI's: no GPU
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    config = RECIPES_DIR / "accelerate" / name
    if name == "deepspeed.yaml":  # retired: no longer shipped, refused with the way to FSDP2
        config = tmp_path / name
        config.write_text(
            "distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config: {zero_stage: 3}\n"
        )
    res = CliRunner().invoke(main, ["uptrain", "tiny", "--accelerate-config", str(config)])
    assert res.exit_code != 0 and message in " ".join(res.output.split()), res.output


def test_a_config_asking_for_gpus_this_machine_lacks_is_refused_with_the_count_it_has(monkeypatch):
    import yaml

    from gqakit.uptrain.cli import launch_problems
    from gqakit.uptrain.recipe import RECIPES_DIR

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    fsdp = yaml.safe_load((RECIPES_DIR / "accelerate" / "fsdp.yaml").read_text())
    (problem,) = launch_problems(fsdp, gpus=2)
    assert "FSDP starts 8 processes on this machine" in problem and "set num_processes: 2" in problem
    assert launch_problems(fsdp, gpus=8) == []
    # the CPU way: every process on the CPU (gloo), one distributed run
    assert launch_problems({**fsdp, "use_cpu": True, "num_processes": 2}, gpus=0) == []
    # one process, or a config without distribution, runs on whatever is here
    assert launch_problems({**fsdp, "num_processes": 1}, gpus=0) == []
    single = yaml.safe_load((RECIPES_DIR / "accelerate" / "single-gpu.yaml").read_text())
    assert launch_problems(single, gpus=0) == []
    (problem,) = launch_problems({**fsdp, "num_processes": 2, "gpu_ids": "0,3"}, gpus=2)
    assert "gpu_ids is 0,3 and this machine has GPU(s) 0 to 1" in problem
    # two machines x 8 GPUs: 8 here (machine 0's address given: the shipped one is a placeholder)
    multi = yaml.safe_load((RECIPES_DIR / "accelerate" / "multi-node.yaml").read_text())
    assert launch_problems(multi, "192.0.2.7", gpus=8) == []
    assert "no GPU" in launch_problems(multi, "192.0.2.7", gpus=0)[0]


def test_the_launch_runs_this_pythons_accelerate_not_one_on_path(monkeypatch, tmp_path):
    """A virtual environment that is not activated has no `accelerate` on PATH: the launch must not look
    it up there (it ended in a FileNotFoundError traceback)."""
    import sys

    from click.testing import CliRunner

    from gqakit.cli import main
    from gqakit.uptrain.recipe import RECIPES_DIR

    seen = []
    monkeypatch.setattr(os, "execvp", lambda *a: pytest.fail("looked the launcher up on PATH"))
    monkeypatch.setattr(os, "execve", lambda prog, argv, env: seen.append((prog, argv, env)))
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to find there
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    config = str(RECIPES_DIR / "accelerate" / "single-gpu.yaml")
    res = CliRunner().invoke(main, ["uptrain", "tiny", "--accelerate-config", config])
    assert res.exit_code == 0, res.output
    ((prog, argv, env),) = seen
    assert prog == sys.executable and argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert "ACCELERATE_USE_CPU" not in env
    # a use_cpu config: every process it starts is told so (accelerate's multi-process launcher does not)
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nnum_machines: 1\nuse_cpu: true\n")
    res = CliRunner().invoke(main, ["uptrain", "tiny", "--accelerate-config", str(cpu)])
    assert res.exit_code == 0, res.output
    assert seen[-1][2]["ACCELERATE_USE_CPU"] == "true"


def test_a_valid_multi_node_launch_runs_accelerate_with_the_address(monkeypatch):
    import sys

    import torch
    from click.testing import CliRunner

    from gqakit.cli import main
    from gqakit.uptrain.recipe import RECIPES_DIR

    seen = []
    monkeypatch.setattr(os, "execve", lambda prog, argv, env: seen.append(argv))
    monkeypatch.setattr(os, "execvp", lambda *a: pytest.fail("looked the launcher up on PATH"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # a machine with the 8 GPUs it asks for
    config = str(RECIPES_DIR / "accelerate" / "multi-node.yaml")
    args = ["uptrain", "tiny", "train.lr=1e-4", "--accelerate-config", config, "--machine-rank", "1"]
    res = CliRunner().invoke(main, [*args, "--main-process-ip", "192.0.2.7", "--resume"])
    assert res.exit_code == 0, res.output
    assert seen == [
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--machine_rank", "1",
         "--main_process_ip", "192.0.2.7", "-m", "gqakit.uptrain", "tiny", "train.lr=1e-4", "--resume"]
    ]  # fmt: skip


def test_a_run_checks_its_inputs_once_before_it_writes_anything(recipe, monkeypatch):
    """One preflight per run (it was entered four times from three files): every check, then the work."""
    from gqakit.uptrain import preflight

    calls = []

    def counting(name: str):
        check = getattr(preflight, name)

        def counted(*args):
            calls.append(name)
            return check(*args)

        return counted

    for name in ("input_problems", "environment_problems", "output_problems"):
        monkeypatch.setattr(preflight, name, counting(name))
    uptrain(recipe("budget.steps=1", "eval.at_start=false", "model.convert=null"))
    assert sorted(calls) == ["environment_problems", "input_problems", "output_problems"]
