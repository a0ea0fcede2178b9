"""Tiny checkpoints in three attention layouts (MHA, GQA, MQA) and a short known text, for eval tests."""

from __future__ import annotations

import pytest

# Non-ASCII on purpose: bits per byte must count UTF-8 bytes, not characters.
KNOWN_TEXT = (
    "Grouped-query attention lets several query heads share one key and value head. "
    "The cache that stores keys and values shrinks by the number of query heads per group. "
    "Café crème, naïve façade: bytes are not characters. "
    "Rivers carry sand to the sea, where waves sort it into beaches of fine grains."
)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{"mha": G=4, "gqa": G=2, "mqa": G=1}, the last two converted from the first with gqakit.convert."""
    from tiny_models import save_tiny_model

    from gqakit.convert import ConvertOptions, convert_checkpoint

    root = tmp_path_factory.mktemp("eval-models")
    mha = save_tiny_model(root / "mha", "llama", heads=4, kv_heads=4)
    convert_checkpoint(mha, root / "gqa", ConvertOptions(groups=2))
    convert_checkpoint(mha, root / "mqa", ConvertOptions(groups=1))
    return {"mha": mha, "gqa": root / "gqa", "mqa": root / "mqa"}


@pytest.fixture(scope="session")
def loaded_mha(tiny_models):
    from gqakit.models import load_causal_lm, load_tokenizer

    path = tiny_models["mha"]
    return load_causal_lm(path, dtype="float32", device="cpu"), load_tokenizer(path)


@pytest.fixture
def known_text():
    return KNOWN_TEXT


@pytest.fixture
def known_txt(tmp_path):
    path = tmp_path / "known.txt"
    path.write_text(KNOWN_TEXT, encoding="utf-8")
    return path
