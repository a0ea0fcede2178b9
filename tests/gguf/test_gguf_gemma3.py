"""Gemma 3's text model (transformers 5's ``gemma3_text`` form) exports what llama.cpp needs; the legacy
form of transformers 4.50-4.52 is refused with one message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_helpers import legacy_gemma3_config, make_checkpoint, read_gguf

from gqakit.gguf.export import export_gguf
from gqakit.gguf.header import RECORDED_CONFIG

_PROVENANCE = ("general.name", RECORDED_CONFIG)
_SLIDING = {"rope_type": "default", "rope_theta": 10_000.0}
# name -> (rope_parameters, layer_types) of a 6-layer model in transformers 5's form
FORMS = {
    "plain": (None, None),
    # gemma-3-4b and up: linear scaling on the full-attention layers only
    "linear-scaling": (
        {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": _SLIDING,
        },
        None,
    ),
    # a pattern other than llama.cpp's default period of 6
    "period-2": (None, ["sliding_attention", "full_attention"] * 3),
}


def _metadata(path: Path) -> tuple[dict, dict]:
    values, _, meta = read_gguf(path)
    return values, {k: v for k, v in meta.items() if k not in _PROVENANCE}


def test_a_legacy_config_is_refused(tmp_path: Path) -> None:
    from gqakit.errors import GqakitError

    src = make_checkpoint(tmp_path, "gemma3_text", 2, layers=6)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(legacy_gemma3_config(cfg)))
    with pytest.raises(GqakitError, match="transformers 4's form: load and save it with transformers 5"):
        export_gguf(src, tmp_path / "m.gguf", "f32", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_the_current_form_states_what_llama_cpp_needs(tmp_path: Path) -> None:
    rope, _ = FORMS["linear-scaling"]
    src = make_checkpoint(tmp_path, "gemma3_text", 2, layers=6, rope_parameters=rope)
    meta = _metadata(export_gguf(src, tmp_path / "m.gguf", "f32", progress=False).path)[1]
    assert meta["gemma3.rope.scaling.type"] == "linear" and meta["gemma3.rope.scaling.factor"] == 8.0
    assert (meta["gemma3.rope.freq_base"], meta["gemma3.rope.freq_base_swa"]) == (1e6, 1e4)
    src = make_checkpoint(tmp_path / "p2", "gemma3_text", 2, layers=6, layer_types=FORMS["period-2"][1])
    meta = _metadata(export_gguf(src, tmp_path / "p2.gguf", "f32", progress=False).path)[1]
    assert meta["gemma3.attention.sliding_window_pattern"] == [True, False] * 3
