"""Two machines on one host (recipes/accelerate/two-machines-cpu.yaml, one CPU process each): a run end to
end; a machine lost mid-run ends the other with a clear error within a bounded time, and ``--resume`` on
both ends bitwise where the uninterrupted run ends; a machine that stops answering ends the other after
the collective timeout. Minutes of CPU: marked slow (commands in docs/uptrain.md "Two machines")."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from gqakit.uptrain import read_history
from gqakit.uptrain.recipe import RECIPES_DIR

pytestmark = pytest.mark.slow

TIMEOUT_S = 20  # GQAKIT_COLLECTIVE_TIMEOUT in these runs


def _config(tmp_path: Path) -> Path:
    """The shipped config on a free port (tests may run beside other launches)."""
    config = yaml.safe_load((RECIPES_DIR / "accelerate" / "two-machines-cpu.yaml").read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        config["main_process_port"] = s.getsockname()[1]
    path = tmp_path / "two-machines.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(autouse=True)
def _no_machine_left():
    """Every machine a test started is gone after it, also when the test failed half-way."""
    yield
    for m in _started:
        if m.poll() is None:
            _signal_machine(m, signal.SIGKILL)
            m.communicate()
    _started.clear()


_started: list[subprocess.Popen] = []


def _machine(rank: int, config: Path, assets, out: Path, *extra: str) -> subprocess.Popen:
    """``gqakit uptrain ... --machine-rank RANK --main-process-ip 127.0.0.1``, as typed in a shell."""
    cmd = [
        sys.executable,
        "-m",
        "gqakit.uptrain",
        str(RECIPES_DIR / "tiny.yaml"),
        f"model.path={assets['mha']}",
        f"data.files=[{assets['train']}]",
        f"output_dir={out}",
        "budget.steps=300",
        "checkpoint.every=10",
        "eval.every=0",
        "--accelerate-config",
        str(config),
        "--machine-rank",
        str(rank),
        "--main-process-ip",
        "127.0.0.1",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GQAKIT_COLLECTIVE_TIMEOUT": str(TIMEOUT_S)}
    _started.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return _started[-1]


def _both(config: Path, assets, out: Path, *extra: str) -> None:
    machines = [_machine(rank, config, assets, out, *extra) for rank in (0, 1)]
    for m in machines:
        _, err = m.communicate(timeout=600)
        assert m.returncode == 0, err[-3000:]


def _signal_machine(machine: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to a machine's every process (its launcher and the worker it started)."""
    parent = psutil.Process(machine.pid)
    for p in [parent, *parent.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def _wait_for_checkpoint(out: Path, machines: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "step-00000010").is_dir():
        assert all(m.poll() is None for m in machines), machines[0].stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 300 s"
        time.sleep(0.2)


def _history(out: Path) -> list[tuple]:
    return [(h["step"], h["loss"], h["lr"], h["grad_norm"]) for h in read_history(out) if "loss" in h]


def test_a_lost_machine_ends_the_other_and_both_resume_to_the_uninterrupted_end(assets, tmp_path):
    config = _config(tmp_path)
    whole = tmp_path / "whole"
    _both(config, assets, whole)  # end to end: two machines, one run
    prov = json.loads((whole / "gqakit.json").read_text())
    assert prov["processes"] == 2

    cut = tmp_path / "cut"
    machines = [_machine(rank, config, assets, cut) for rank in (0, 1)]
    _wait_for_checkpoint(cut, machines)
    _signal_machine(machines[1], signal.SIGKILL)  # machine 1 is gone: its processes and their sockets
    lost = time.monotonic()
    _, err = machines[0].communicate(timeout=TIMEOUT_S + 120)
    assert machines[0].returncode != 0
    assert time.monotonic() - lost < TIMEOUT_S + 120
    assert "This run lost another of its processes" in err, err[-3000:]
    assert "--resume, on every machine" in err
    assert not (cut / "model.safetensors").exists()

    _both(config, assets, cut, "--resume")
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _history(cut) == _history(whole)


def test_a_machine_that_stops_answering_ends_the_other_after_the_collective_timeout(assets, tmp_path):
    config = _config(tmp_path)
    out = tmp_path / "run"
    machines = [_machine(rank, config, assets, out) for rank in (0, 1)]
    _wait_for_checkpoint(out, machines)
    _signal_machine(machines[1], signal.SIGSTOP)  # frozen: its sockets stay open, nothing answers
    stopped = time.monotonic()
    _, err = machines[0].communicate(timeout=TIMEOUT_S + 120)
    waited = time.monotonic() - stopped
    assert machines[0].returncode != 0
    assert TIMEOUT_S - 1 <= waited < TIMEOUT_S + 120  # the timeout, not torch's 30 minutes
    assert "This run lost another of its processes" in err and "Timed out" in err, err[-3000:]
