"""Shared test setup: offline hubs, a cache of the session's own, tiny checkpoints, and the gpu skip."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# tests/tiny_models.py (tiny checkpoints built in code) imports as tiny_models from every test folder.
sys.path.insert(0, str(Path(__file__).parent))

# Everything tested runs offline: no test may reach a model or dataset hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


REAL_CACHE = "real_cache"  # the marker of a test that reads the user's cached assets
_USER_CACHE = os.environ.get("GQAKIT_CACHE")  # before the session's own replaces it


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$GQAKIT_CACHE, for the whole session, an empty folder of the session's own: no test, fixture or
    subprocess writes into the user's cache (each .gguf a test builds would leave its dequantized copy
    there, each checkpoint evaluated with llama.cpp its export). A test may point it elsewhere itself."""
    cache = tmp_path_factory.mktemp("gqakit-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GQAKIT_CACHE", str(cache))
        yield cache


@pytest.fixture(autouse=True)
def _real_cache(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``real_cache`` sees the user's cache, as the session found $GQAKIT_CACHE."""
    if request.node.get_closest_marker(REAL_CACHE) is None:
        return
    if _USER_CACHE is None:
        monkeypatch.delenv("GQAKIT_CACHE", raising=False)
    else:
        monkeypatch.setenv("GQAKIT_CACHE", _USER_CACHE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: that holds folder names too
            item.add_marker(skip)


@pytest.fixture
def standin_python(tmp_path, monkeypatch):
    """A fake "Python with vLLM" set as $GQAKIT_VLLM_PYTHON: it answers the vLLM probe and runs
    tests/vllm_standin.py (the worker's protocol, answered by transformers) instead of the real worker."""
    import stat
    import sys

    from gqakit.eval.vllm_engine import ENV_VAR

    standin = Path(__file__).with_name("vllm_standin.py")
    fake = tmp_path / "vllm-python"
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then exit 0; fi\nshift\nexec {sys.executable} {standin} "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(ENV_VAR, str(fake))
    return fake


@pytest.fixture
def tiny_llama(tmp_path):
    """A saved 2-layer llama with 4 query heads and 4 K/V heads, with its tokenizer."""
    from tiny_models import save_tiny_model

    return save_tiny_model(tmp_path / "tiny-llama", "llama", heads=4, kv_heads=4)
