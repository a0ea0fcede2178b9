"""A session-wide cache of tiny checkpoints and their GGUF exports, shared by the GGUF tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gguf_helpers import FORMS, make_checkpoint

from gqakit.gguf.export import ExportResult, export_gguf


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """``checkpoint(family, form, tokenizer="bpe")`` -> a saved tiny model, built once per session."""
    root = tmp_path_factory.mktemp("gguf-ckpt")
    cache: dict[tuple, Path] = {}

    def get(family: str, form: str, tokenizer: str = "bpe") -> Path:
        key = (family, form, tokenizer)
        if key not in cache:
            cache[key] = make_checkpoint(root, family, FORMS[form], tokenizer)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def exported(checkpoint, tmp_path_factory) -> Callable[..., tuple[Path, ExportResult]]:
    """``exported(family, form, out_type="f32", tokenizer="bpe")`` -> (checkpoint, export result)."""
    root = tmp_path_factory.mktemp("gguf-out")
    cache: dict[tuple, tuple[Path, ExportResult]] = {}

    def get(family: str, form: str, out_type: str = "f32", tokenizer: str = "bpe"):
        key = (family, form, out_type, tokenizer)
        if key not in cache:
            src = checkpoint(family, form, tokenizer)
            cache[key] = (src, export_gguf(src, root / f"{src.name}-{out_type}.gguf", out_type))
        return cache[key]

    return get
