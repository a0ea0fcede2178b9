"""FSDP2 over two CPU processes (gloo) through the shipped recipes/accelerate/fsdp-cpu.yaml: a distillation
run with the teacher sharded matches one process at the same global batch, and a run killed with SIGKILL
right after a checkpoint resumes to the uninterrupted run's final weights, bit for bit."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gqakit.uptrain import read_history, uptrain
from gqakit.uptrain.cli import launch_env
from gqakit.uptrain.recipe import RECIPES_DIR

CONFIG = str(RECIPES_DIR / "accelerate" / "fsdp-cpu.yaml")
# Distillation (the teacher sharded too) into another model (with tied embeddings), 6 steps, a checkpoint
# every 2; 2 blocks per process = 4 a step.
COMMON = (
    "objective.kind=distill", "model.convert=null", "budget.steps=6", "eval.every=0", "eval.at_start=false",
    "checkpoint.every=2", "checkpoint.keep_after_finish=true", "train.batch_size=2",
)  # fmt: skip


def _launch(assets, out: Path, *args: str, entry: tuple[str, ...] = ("-m", "gqakit.uptrain")):
    """``accelerate launch --config_file fsdp-cpu.yaml`` of recipes/tiny.yaml, in the environment
    ``gqakit uptrain --accelerate-config`` gives it (its processes told they run on the CPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG,
        "--main_process_port", str(port), *entry, str(RECIPES_DIR / "tiny.yaml"),
        f"model.path={assets['tied']}", f"teacher={assets['mha']}", f"data.files=[{assets['train']}]",
        f"output_dir={out}", *COMMON, *args,
    ]  # fmt: skip
    env = {**launch_env(yaml.safe_load(Path(CONFIG).read_text())), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def full(assets, tmp_path_factory) -> tuple[Path, str]:
    """The uninterrupted two-process run: its directory and its log."""
    out = tmp_path_factory.mktemp("fsdp") / "full"
    proc = _launch(assets, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


def test_two_fsdp_processes_distill_like_one_with_the_teacher_sharded(full, recipe, assets, tmp_path):
    out, log = full
    prov = json.loads((out / "gqakit.json").read_text())
    assert prov["processes"] == 2 and prov["distributed_type"] == "FSDP"
    assert log.count("sharded over 2 processes (fully_shard)") == 1, log[-3000:]  # one line, main process
    ckpt = out / "checkpoints" / "step-00000004"
    shards = {"model_shard_0.safetensors", "model_shard_1.safetensors", "optimizer_shard_0.pt"}
    assert {p.name for p in ckpt.glob("*_shard_*")} == {*shards, "optimizer_shard_1.pt"}
    one = uptrain(
        recipe(
            *COMMON,
            f"teacher={assets['mha']}",
            "train.batch_size=4",
            f"output_dir={tmp_path / 'one'}",
            model="tied",
        )
    )
    assert abs(prov["final_val_ppl"] - one.final_val_ppl) < 5e-3 * one.final_val_ppl
    assert prov["tokens"] == one.tokens


def test_fsdp_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_weights(full, assets, tmp_path):
    out, _ = full
    cut = tmp_path / "cut"
    killer = (str(Path(__file__).parent / "die_after_step.py"), "5")  # SIGKILL right after step 5
    killed = _launch(assets, cut, entry=killer)
    assert killed.returncode != 0
    assert sorted(p.name for p in (cut / "checkpoints").iterdir())[-1] == "step-00000004"
    assert not (cut / "model.safetensors").exists()
    resumed = _launch(assets, cut, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr

    def numbers(run):
        return [(h["step"], h["loss"], h["lr"], h["grad_norm"]) for h in read_history(run) if "loss" in h]

    assert numbers(cut) == numbers(out)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), {k: (a[k] - b[k]).abs().max().item() for k in a}
