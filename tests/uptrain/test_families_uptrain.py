"""A recipe whose source is GPT-2 or GPT-NeoX converts it into its target class first, then trains
(language-model loss on the tiny text falls)."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_model

from gqakit.uptrain import uptrain
from gqakit.uptrain.recipe import RECIPES_DIR, load_recipe

TINY_RECIPE = RECIPES_DIR / "tiny.yaml"


@pytest.mark.parametrize(("family", "groups", "target"), [("gpt2", 1, "gpt_bigcode"), ("gpt_neox", 2, "phi")])
def test_recipe_converts_a_retargeted_family_and_its_loss_falls(assets, tmp_path, family, groups, target):
    src = save_tiny_model(tmp_path / family, family)
    r = load_recipe(
        TINY_RECIPE,
        [
            f"model.path={src}", f"teacher={src}", f"data.files=[{assets['train']}]",
            f"output_dir={tmp_path / 'run'}", f"model.convert.groups={groups}",
            "budget.steps=12", "eval.every=12", "checkpoint.every=0",
        ],
    )  # fmt: skip
    result = uptrain(r)
    config = json.loads((result.output_dir / "config.json").read_text())
    assert config["model_type"] == target
    losses = [m["loss"] for m in map(json.loads, (result.output_dir / "metrics.jsonl").open()) if "loss" in m]
    assert losses[-1] < losses[0]
