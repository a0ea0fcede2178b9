"""Gemma 3 in every config form it ships in exports the same GGUF: the legacy names of transformers
4.50-4.52 (``rope_local_base_freq``, ``rope_scaling``, ``sliding_window_pattern``) and the multimodal
``gemma3`` config whose text model sits under ``text_config``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_helpers import legacy_gemma3_config, make_checkpoint, read_gguf, save_gemma3_multimodal

import gqakit.gguf.dequantize as deq
from gqakit.gguf.export import export_gguf
from gqakit.gguf.header import RECORDED_CONFIG

_PROVENANCE = ("general.name", "general.source.url", "gqakit.source", RECORDED_CONFIG)
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


@pytest.mark.parametrize("form", list(FORMS))
def test_a_legacy_config_exports_what_its_current_form_does(tmp_path: Path, form: str) -> None:
    rope, kinds = FORMS[form]
    overrides = {
        "layers": 6,
        **({"rope_parameters": rope} if rope else {}),
        **({"layer_types": kinds} if kinds else {}),
    }
    current = make_checkpoint(tmp_path, "gemma3_text", 2, **overrides)
    legacy = shutil.copytree(current, tmp_path / "legacy")
    cfg = json.loads((current / "config.json").read_text())
    (legacy / "config.json").write_text(json.dumps(legacy_gemma3_config(cfg)))
    want_values, want = _metadata(export_gguf(current, tmp_path / "current.gguf", "f32", progress=False).path)
    got_values, got = _metadata(export_gguf(legacy, tmp_path / "legacy.gguf", "f32", progress=False).path)
    assert got == want
    assert got["gemma3.rope.freq_base_swa"] == 10_000.0  # rope_local_base_freq, not rope_theta's 1M
    for name, value in want_values.items():
        np.testing.assert_array_equal(got_values[name], value, err_msg=name)


def test_the_current_form_states_what_llama_cpp_needs(tmp_path: Path) -> None:
    """The reference of the test above, checked against the config itself."""
    rope, _ = FORMS["linear-scaling"]
    src = make_checkpoint(tmp_path, "gemma3_text", 2, layers=6, rope_parameters=rope)
    meta = _metadata(export_gguf(src, tmp_path / "m.gguf", "f32", progress=False).path)[1]
    assert meta["gemma3.rope.scaling.type"] == "linear" and meta["gemma3.rope.scaling.factor"] == 8.0
    assert (meta["gemma3.rope.freq_base"], meta["gemma3.rope.freq_base_swa"]) == (1e6, 1e4)
    src = make_checkpoint(tmp_path / "p2", "gemma3_text", 2, layers=6, layer_types=FORMS["period-2"][1])
    meta = _metadata(export_gguf(src, tmp_path / "p2.gguf", "f32", progress=False).path)[1]
    assert meta["gemma3.attention.sliding_window_pattern"] == [True, False] * 3


@pytest.mark.parametrize("legacy_text", [False, True], ids=["current", "legacy-text-config"])
def test_a_multimodal_gemma3_exports_its_text_model(tmp_path: Path, legacy_text: bool) -> None:
    src = save_gemma3_multimodal(tmp_path / "mm", query_pre_attn_scalar=32)
    if legacy_text:
        cfg = json.loads((src / "config.json").read_text())
        cfg["text_config"] = legacy_gemma3_config(cfg["text_config"])
        (src / "config.json").write_text(json.dumps(cfg))
    r = export_gguf(src, tmp_path / "mm.gguf", "f32", progress=False)
    assert r.arch == "gemma3" and r.num_heads == 4 and r.num_kv_heads == 2
    assert any("not exported" in w and "mmproj" in w for w in r.warnings)
    values, meta = _metadata(r.path)
    assert meta["gemma3.block_count"] == 2 and meta["gemma3.attention.key_length"] == 16
    assert meta["gemma3.rope.freq_base_swa"] == 10_000.0
    assert not any("vision" in name or "mm_" in name for name in values)
    # read back as gqakit reads a GGUF: the text model, computing what the multimodal model does on text
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    deq.dequantize_gguf(r.path, tmp_path / "back")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    original = Gemma3ForConditionalGeneration.from_pretrained(src).eval()
    ids = torch.tensor([[5, 17, 42, 7, 99, 3, 250, 11]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, original(input_ids=ids).logits, rtol=0, atol=0)
    assert back.config.query_pre_attn_scalar == 32


def test_a_gemma3_config_transformers_refuses_is_one_message(tmp_path: Path) -> None:
    from gqakit.errors import GqakitError

    src = make_checkpoint(tmp_path, "gemma3_text", 2)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "hidden_size": 66}))  # not a multiple of 4 heads
    with pytest.raises(GqakitError, match="not one transformers can load.*not a multiple"):
        export_gguf(src, tmp_path / "m.gguf", "f32", progress=False)
