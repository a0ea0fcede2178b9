"""``speed.device``: where a single-process run trains, whatever accelerate would pick by itself. Checked
on a machine without a GPU by making ``torch.cuda.is_available`` say there is one (accelerate then picks
CUDA, as on a GPU machine); nothing here touches a GPU."""

from __future__ import annotations

import pytest
import torch

from gqakit.errors import GqakitError
from gqakit.uptrain import recipe_from_dict
from gqakit.uptrain.preflight import environment_problems, process_state
from gqakit.uptrain.recipe import RecipeError
from gqakit.uptrain.setup import make_accelerator
from gqakit.uptrain.train import validation_perplexity


@pytest.fixture
def gpu_machine(monkeypatch):
    """accelerate's view of a machine with a CUDA GPU; its process state made afresh before and after,
    so neither this test nor the next one sees a device another picked."""
    # deferred: accelerate takes seconds to import
    from accelerate import PartialState

    PartialState._reset_state()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    yield
    monkeypatch.undo()
    PartialState._reset_state()


def _recipe(device: str, tmp_path, model: str = "m", **sections) -> object:
    return recipe_from_dict(
        {"model": {"path": model}, "data": {"files": [str(tmp_path / "t.txt")], "seq_len": 32},
         "budget": {"steps": 1}, "output_dir": str(tmp_path / "out"),
         "speed": {"device": device}, **sections}
    )  # fmt: skip


def test_a_single_process_trains_on_the_device_the_recipe_names(gpu_machine, tmp_path):
    assert process_state().device.type == "cuda"  # what accelerate picks on this machine by itself
    acc = make_accelerator(_recipe("cpu", tmp_path))  # the accelerator a run builds
    assert acc.device.type == "cpu"
    assert process_state().device == torch.device("cpu")  # None: the state as it is
    assert make_accelerator(_recipe("auto", tmp_path)).device.type == "cpu"  # auto: where it trains
    # a process trains on one device: a recipe naming another is refused
    with pytest.raises(GqakitError, match="this process already trains on cpu, and a process trains on one"):
        process_state("cuda")


def test_a_cpu_run_on_a_gpu_machine_trains_on_the_cpu(gpu_machine, tmp_path, assets):
    """The reference evaluation of ``gqakit recovery --device cpu`` on a GPU machine: before
    ``speed.device`` it went to CUDA (here: a machine whose CUDA is make-believe, so it failed)."""
    recipe = _recipe("cpu", tmp_path, str(assets["mha"]), data={
        "files": [str(assets["train"])], "val_files": [str(assets["val"])], "seq_len": 32,
        "max_val_blocks": 2})  # fmt: skip
    ppl, blocks = validation_perplexity(recipe, str(assets["mha"]))
    assert ppl > 1 and blocks == 2


def test_a_bad_device_is_a_recipe_problem(tmp_path):
    for good in ("auto", "cpu", "cuda", "cuda:1"):
        assert _recipe(good, tmp_path).speed.device == good
    with pytest.raises(RecipeError, match="speed.device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        _recipe("gpu", tmp_path)


def test_a_distributed_launch_takes_no_device(tmp_path):
    problems = environment_problems(_recipe("cuda", tmp_path), "MULTI_GPU", "cuda")
    assert len(problems) == 1 and "speed.device=cuda puts a single process on a device" in problems[0]
    assert "set speed.device=auto" in problems[0]
    assert environment_problems(_recipe("auto", tmp_path), "MULTI_GPU", "cuda") == []
    assert environment_problems(_recipe("cpu", tmp_path), "NO", "cpu") == []


def test_a_run_on_another_gpu_makes_it_the_current_device(gpu_machine, monkeypatch):
    """``cuda:1`` makes GPU 1 the current device (autocast and compile follow it)."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(0, torch.device(d).index))
    assert process_state("cuda:1").device == torch.device("cuda:1") and current == [1]
    assert process_state("auto").device == torch.device("cuda:1")


def test_a_device_this_machine_lacks_is_one_of_the_recipes_problems(tmp_path):
    """Reported with the others, in the recipe's terms (``gqakit uptrain`` has no --device)."""
    from gqakit.uptrain.preflight import preflight

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(GqakitError) as e:
        preflight(_recipe("cuda", tmp_path))
    assert "speed.device=cuda, but this machine has no CUDA device: set speed.device=cpu or auto." in str(
        e.value
    )
    assert "t.txt does not exist" in str(e.value)  # and the other problems, together


def test_a_recipes_conversion_runs_where_the_recipe_trains(gpu_machine, recipe, assets):
    """``model.convert`` with ``speed.device=cpu`` on a GPU machine calibrates on the CPU too (on this
    make-believe CUDA, a conversion sent there fails)."""
    from gqakit.uptrain import uptrain

    r = recipe(
        "model.convert.method=calibrated", f"model.convert.calib_data={assets['train']}",
        "model.convert.calib_tokens=256", "speed.device=cpu", "budget.steps=2", "eval.at_start=false",
    )  # fmt: skip
    res = uptrain(r)
    assert res.steps == 2
