"""One GPU: bf16 training, FSDP2 through ``accelerate launch`` (one process) matching a plain run, and an
FSDP2 run killed after a checkpoint and resumed reaching the weights of an uninterrupted one.

Marked ``gpu``: the default test run deselects them, and they skip where no CUDA GPU is present.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from gqakit.uptrain import read_history, uptrain
from gqakit.uptrain.recipe import RECIPES_DIR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _losses(run_dir) -> list[float]:
    return [h["loss"] for h in read_history(run_dir) if "loss" in h]


def test_bf16_on_one_gpu_trains_and_saves_a_plain_checkpoint(recipe):
    res = uptrain(recipe("train.precision=bf16", "budget.steps=30"))
    prov = json.loads((res.output_dir / "gqakit.json").read_text())
    assert prov["precision"] == "bf16" and prov["processes"] == 1
    losses = _losses(res.output_dir)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert res.final_val_ppl < res.initial_val_ppl
    model = AutoModelForCausalLM.from_pretrained(res.output_dir).cuda()
    assert model.config.num_key_value_heads == 2
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]], device="cuda")).logits).all()


def _launch_fsdp(assets, out, *args: str, entry: tuple[str, ...] = ("-m", "gqakit.uptrain")):
    """``accelerate launch`` recipes/tiny.yaml on one GPU through recipes/accelerate/fsdp.yaml."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(RECIPES_DIR / "accelerate" / "fsdp.yaml"),
        "--num_processes",
        "1",
        "--main_process_port",
        str(port),
        *entry,
        str(RECIPES_DIR / "tiny.yaml"),
        f"model.path={assets['mha']}",
        f"data.files=[{assets['train']}]",
        f"output_dir={out}",
        *args,
    ]
    return subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=600)


def test_fsdp2_on_one_gpu_matches_a_plain_run(recipe, assets, tmp_path):
    common = ["budget.steps=6", "eval.every=3", "checkpoint.every=3", "train.precision=fp32"]
    plain = uptrain(recipe(*common, f"output_dir={tmp_path / 'plain'}"))
    fsdp_dir = tmp_path / "fsdp"
    proc = _launch_fsdp(assets, fsdp_dir, *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prov = json.loads((fsdp_dir / "gqakit.json").read_text())
    assert prov["distributed_type"] == "FSDP"
    torch.testing.assert_close(
        torch.tensor(_losses(fsdp_dir)), torch.tensor(_losses(plain.output_dir)), rtol=1e-3, atol=1e-3
    )
    # The final model is gathered into one ordinary checkpoint that vanilla transformers loads.
    a = load_file(str(plain.output_dir / "model.safetensors"))
    b = load_file(str(fsdp_dir / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-2, atol=1e-3, msg=k)
    AutoModelForCausalLM.from_pretrained(fsdp_dir)


def test_fsdp2_killed_after_a_checkpoint_resumes_to_the_uninterrupted_weights(assets, tmp_path):
    common = ["budget.steps=8", "eval.every=4", "checkpoint.every=4", "train.precision=bf16"]
    full = _launch_fsdp(assets, tmp_path / "full", *common)
    assert full.returncode == 0, full.stderr[-3000:]
    # The same run, killed (SIGKILL, no cleanup) right after step 6: its step-4 checkpoint survives.
    cut = tmp_path / "cut"
    killer = (str(Path(__file__).parent / "die_after_step.py"), "6")
    killed = _launch_fsdp(assets, cut, *common, entry=killer)
    assert killed.returncode != 0
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-00000004"]
    assert not (cut / "model.safetensors").exists()
    resumed = _launch_fsdp(assets, cut, *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr

    def numbers(run):
        return [(h["step"], h["loss"], h["lr"], h["grad_norm"]) for h in read_history(run) if "loss" in h]

    # Same GPU, same kernels, same data order and RNG state after the resume: bitwise the same.
    assert numbers(cut) == numbers(tmp_path / "full")
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys()
    diffs = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}
    assert all(torch.equal(a[k], b[k]) for k in a), diffs


def test_speed_levers_train_like_the_plain_loop_on_a_gpu(recipe, tmp_path):
    common = ("budget.steps=10", "train.precision=bf16", "objective.kind=mix", "checkpoint.every=0")
    plain = uptrain(
        recipe(*common, "speed.fused_loss=false", "speed.compile=false", f"output_dir={tmp_path / 'p'}")
    )
    fast = uptrain(recipe(*common, "speed.compile=true", f"output_dir={tmp_path / 'f'}"))
    a, b = torch.tensor(_losses(fast.output_dir)), torch.tensor(_losses(plain.output_dir))
    # bf16 rounding differs between fused and unfused kernels and grows over the steps; 2% bounds it.
    torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
    assert abs(fast.final_val_ppl - plain.final_val_ppl) < 2e-2 * plain.final_val_ppl
