"""Two CPU processes (gloo, through ``accelerate launch``) train like one with the same global batch, log
once, and resume from a checkpoint to bitwise the same weights."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import torch
from safetensors.torch import load_file

from gqakit.uptrain import read_history, uptrain
from gqakit.uptrain.recipe import RECIPES_DIR


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two(args: list[str]) -> subprocess.CompletedProcess:
    # `--cpu --num_processes 2` starts one process; `--multi_gpu` + ACCELERATE_USE_CPU starts two (gloo).
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        "-m",
        "gqakit.uptrain",
        str(RECIPES_DIR / "tiny.yaml"),
        *args,
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_two_processes_match_one_with_the_same_global_batch(recipe, assets, tmp_path):
    common = ["budget.steps=6", "eval.every=3", "checkpoint.every=3", "checkpoint.keep_after_finish=true"]
    one = uptrain(recipe(*common, "train.batch_size=4", f"output_dir={tmp_path / 'one'}"))

    two_dir = tmp_path / "two"
    overrides = [
        f"model.path={assets['mha']}",
        f"data.files=[{assets['train']}]",
        f"output_dir={two_dir}",
        "train.batch_size=2",  # x 2 processes = the single run's 4
        *common,
    ]
    proc = _launch_two(overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("gqakit.uptrain: budget:") == 1, proc.stderr[-3000:]  # main process only

    prov = json.loads((two_dir / "gqakit.json").read_text())
    assert prov["processes"] == 2 and prov["distributed_type"] == "MULTI_CPU"
    ckpt = next((two_dir / "checkpoints").iterdir())
    assert {p.name for p in ckpt.glob("rng_state_*.pt")} == {"rng_state_0.pt", "rng_state_1.pt"}
    assert prov["tokens"] == one.tokens

    loss_one = [h["loss"] for h in read_history(one.output_dir) if "loss" in h]
    loss_two = [h["loss"] for h in read_history(two_dir) if "loss" in h]
    torch.testing.assert_close(torch.tensor(loss_two), torch.tensor(loss_one), rtol=1e-4, atol=1e-4)
    a, b = load_file(str(one.output_dir / "model.safetensors")), load_file(str(two_dir / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-4, msg=k)
    assert (
        prov["final_val_ppl"] == torch.tensor(one.final_val_ppl).item()
        or abs(prov["final_val_ppl"] - one.final_val_ppl) < 1e-3 * one.final_val_ppl
    )

    # Resume the two-process run from its step-3 checkpoint, as after a kill at step 5: bitwise the same.
    cut = tmp_path / "cut"
    shutil.copytree(two_dir, cut)
    for name in ("gqakit.json", "model.safetensors"):  # the finished model: not there yet at step 5
        (cut / name).unlink()
    proc = _launch_two([*overrides[:2], f"output_dir={cut}", *overrides[3:], "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    c = load_file(str(cut / "model.safetensors"))
    assert all(torch.equal(c[k], b[k]) for k in b)

    def numbers(run):
        return [(h["step"], h["loss"], h["lr"], h["grad_norm"]) for h in read_history(run) if "loss" in h]

    assert numbers(cut) == numbers(two_dir)


def test_both_processes_stop_when_another_run_holds_the_run_directory(assets, tmp_path):
    from gqakit.uptrain.setup import run_dir

    with run_dir(tmp_path / "held", False, False, lambda: None):  # as a run under way holds it
        held = f"output_dir={tmp_path / 'held'}"
        proc = _launch_two([f"model.path={assets['mha']}", f"data.files=[{assets['train']}]", held])
    assert proc.returncode != 0
    assert "held is in use by another run (pid" in proc.stderr, proc.stderr[-3000:]
    assert "budget:" not in proc.stderr  # neither process started training
    assert not any((tmp_path / "held").iterdir())  # nothing written into it
