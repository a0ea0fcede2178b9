"""``gqakit replicate``'s cache keys: what each measurement and training run is reused for (the device, a
run killed under progress bars), with the measurements and training stood in for."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_TEXT

import gqakit.models as devices
from gqakit.pipelines.replicate import train
from gqakit.pipelines.replicate.options import ReplicateOptions


@pytest.fixture
def measure(tmp_path, monkeypatch):
    """Measures one perplexity and the decode times in a working directory, and says which of the two
    ran: the measurements themselves are stood in for (these tests are about when they run)."""
    from types import SimpleNamespace

    from tiny_models import save_tiny_model

    from gqakit.pipelines.steps import Steps
    from gqakit.pipelines.store import ResultStore

    m4 = save_tiny_model(tmp_path / "g4", "llama", heads=4, kv_heads=4, tokenizer=False)
    m1 = save_tiny_model(tmp_path / "g1", "llama", heads=4, kv_heads=1, tokenizer=False)
    test = tmp_path / "test.txt"
    test.write_text(TINY_TEXT)
    runs: list[str] = []
    monkeypatch.setattr(train, "load_causal_lm", lambda *a, **k: runs.append("ppl"))
    monkeypatch.setattr(train, "load_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(train, "perplexity", lambda *a, **k: SimpleNamespace(ppl=2.0, tokens=8))
    point = SimpleNamespace(tokens_per_s=100.0)
    monkeypatch.setattr(
        train, "decode_rounds", lambda paths, **k: runs.append("decode") or [[point] for _ in paths]
    )
    o = ReplicateOptions(device="auto", echo=lambda m: None)
    ctx = train.Context(o, ResultStore(tmp_path / "results"), Steps(1, o.echo), tmp_path, *(test,) * 3)

    def measured() -> list[str]:
        runs.clear()
        train.perplexity_of(ctx, m1)
        train.decode_times(ctx, {4: m4, 1: m1})
        return sorted(runs)

    return measured


def _on_gpu(monkeypatch, name: str) -> None:
    """This machine as one whose ``auto`` means a CUDA GPU called ``name``."""
    monkeypatch.setattr(train, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_perplexity_and_decode_time_are_measured_again_on_another_device(measure, monkeypatch):
    assert measure() == ["decode", "ppl"] and measure() == []  # the same machine reuses both
    # the working directory moved to a machine where auto means CUDA
    _on_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB")
    assert measure() == ["decode", "ppl"] and measure() == []


def test_decode_times_are_measured_again_on_another_gpu_or_cpu_model(measure, monkeypatch):
    _on_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB")
    assert measure() == ["decode", "ppl"]
    # the working directory moved to another GPU model: its decode times are its own; the perplexity
    # stands (float32 on either GPU, the same up to rounding)
    _on_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert measure() == ["decode"] and measure() == []

    # on a CPU, then on another CPU model
    monkeypatch.setattr(train, "resolve_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(devices, "cpu_model", lambda: "Intel(R) Xeon(R) Platinum 8480+")
    assert measure() == ["decode", "ppl"]
    monkeypatch.setattr(devices, "cpu_model", lambda: "AMD EPYC 9654")
    assert measure() == ["decode"]


def test_a_device_name_says_the_model_and_for_a_cpu_the_cpus_it_may_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert devices.device_name(torch.device("cuda")) == "cuda: NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(devices, "cpu_model", lambda: "AMD EPYC 9654")
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert devices.device_name(torch.device("cpu")) == "cpu: AMD EPYC 9654, 3 CPUs"


def test_a_run_killed_under_progress_bars_resumes_without_them(tmp_path):
    from gqakit.pipelines.steps import same_run
    from gqakit.uptrain import recipe_from_dict

    def recipe(progress: bool, lr: float = 1e-3, device: str = "auto"):
        o = ReplicateOptions(progress=progress, device=device, sets=(f"train.lr={lr}",))
        ctx = train.Context(o, None, None, tmp_path, *(tmp_path / "t.txt",) * 3)  # type: ignore[arg-type]
        return recipe_from_dict(train.recipe_data(ctx, tmp_path / "start", tmp_path / "out", 10, 0, True))

    out = tmp_path / "out"
    out.mkdir()
    (out / "recipe.yaml").write_text(recipe(True).to_yaml())
    assert same_run(out, recipe(False))
    assert not same_run(out, recipe(False, lr=2e-3))
    # killed under another --device, or written before recipes held speed.device: resumed, not restarted
    assert same_run(out, recipe(False, device="cpu"))
    (out / "recipe.yaml").write_text(recipe(True).to_yaml().replace("  device: auto\n", ""))
    assert same_run(out, recipe(False))


def test_the_training_recipe_names_the_device_and_its_cache_key_does_not(tmp_path):
    from gqakit.pipelines.steps import weights_key
    from gqakit.uptrain import recipe_from_dict

    keys = []
    texts = (tmp_path / "t.txt",) * 3
    for device in ("cpu", "cuda", "auto"):
        ctx = train.Context(ReplicateOptions(device=device), None, None, tmp_path, *texts)  # type: ignore[arg-type]
        data = train.recipe_data(ctx, tmp_path / "start", tmp_path / "out", 10, 0)
        assert recipe_from_dict(data).speed.device == device  # "auto": where accelerate puts it
        keys.append(weights_key(data))
    assert keys[0] == keys[1] == keys[2]
