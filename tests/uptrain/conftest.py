"""Tiny models, text and recipes for the uptraining tests (built once per session)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_models import TINY_TEXT, save_tiny_model

from gqakit.uptrain.recipe import RECIPES_DIR, load_recipe

TINY_RECIPE = RECIPES_DIR / "tiny.yaml"


def write_text(path: Path, lines: int, seed: int = 0) -> Path:
    """``lines`` documents, one per line, each five shuffled sentences of the tiny corpus."""
    rng = random.Random(seed)
    sentences = [s.strip() for s in TINY_TEXT.split(". ") if s.strip()]
    path.write_text("\n".join(". ".join(rng.sample(sentences, 5)) + "." for _ in range(lines)) + "\n")
    return path


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster, and much faster on a busy machine (no oversubscription)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("uptrain-assets")
    return {
        "mha": save_tiny_model(root / "mha", "llama", heads=4, kv_heads=4),
        "tied": save_tiny_model(root / "tied", "llama", heads=4, kv_heads=4, tie_word_embeddings=True),
        "train": write_text(root / "train.txt", 300),
        "val": write_text(root / "val.txt", 20, seed=1),
    }


@pytest.fixture
def recipe(assets, tmp_path):
    """``recipe(*overrides)``: recipes/tiny.yaml pointed at the tiny assets and a fresh output dir."""

    def make(*overrides: str, model: str = "mha"):
        base = [
            f"model.path={assets[model]}",
            f"teacher={assets[model]}",
            f"data.files=[{assets['train']}]",
            f"output_dir={tmp_path / 'run'}",
        ]
        return load_recipe(TINY_RECIPE, [*base, *overrides])

    return make


@pytest.fixture
def poison_loss(monkeypatch):
    """``poison_loss(batches, value)``: the loss of the micro-batches drawn as number ``batches`` (the
    loop's ``batches_seen`` when the loss is computed) is multiplied by ``value`` (inf or nan)."""
    from gqakit.uptrain import train

    loss_step = train.loss_step

    def poison(batches: set[int], value: float) -> None:
        def poisoned(run, batch):
            loss, parts = loss_step(run, batch)
            return (loss * value, parts) if run.state.batches_seen in batches else (loss, parts)

        monkeypatch.setattr(train, "loss_step", poisoned)

    return poison
