"""A GGUF read back the way gqakit reads one (transformers' loader, then gqakit's config repairs) computes
the model it was exported from: the facts transformers' GGUF reader drops (Gemma's attention scale,
Phi-3's partial rotary, Llama's biases) come back from the config the export records, or, for a file
without that record, from what llama.cpp itself reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_helpers import make_checkpoint
from safetensors.torch import load_file, save_file

import gqakit.gguf.dequantize as deq
import gqakit.gguf.export as export_mod
from gqakit.errors import GqakitError
from gqakit.gguf.export import export_gguf
from gqakit.gguf.header import gguf_config
from gqakit.storage import cache_root, fingerprint

IDS = torch.tensor([[5, 17, 42, 7, 99, 3, 250, 11, 64, 128]])
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
# (family, config overrides, the fields transformers' GGUF reader got wrong before gqakit restored them)
LOST = {
    # query_pre_attn_scalar 64: neither transformers' default (256) nor llama.cpp's head_dim (16)
    "gemma3-scale": ("gemma3_text", {"query_pre_attn_scalar": 64}, ["query_pre_attn_scalar"]),
    "gemma2-scale": ("gemma2", {"query_pre_attn_scalar": 64}, ["query_pre_attn_scalar"]),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}, ["rope_parameters"]),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}, ["attention_bias", "mlp_bias"]),
    # llama3 rotary scaling travels as the rope_freqs tensor, which transformers does not read
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}, ["rope_parameters"]),
}


def _logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def _read_back(gguf: Path, out: Path) -> tuple[Path, dict]:
    deq.dequantize_gguf(gguf, out)
    return out, json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("case", list(LOST))
def test_the_model_read_back_is_the_model_exported(tmp_path: Path, case: str) -> None:
    family, overrides, fields = LOST[case]
    src = make_checkpoint(tmp_path, family, 2, **overrides)
    r = export_gguf(src, tmp_path / "m.gguf", "f32", progress=False)
    back, cfg = _read_back(r.path, tmp_path / "back")
    original = json.loads((src / "config.json").read_text())
    for field in fields:
        assert cfg[field] == original[field], field
    torch.testing.assert_close(_logits(back), _logits(src), rtol=0, atol=0)


@pytest.fixture
def unrecorded(monkeypatch):
    """Exports write no config record, as llama.cpp's converter and earlier gqakit exports do not."""
    monkeypatch.setattr(export_mod, "RECORDED_CONFIG", "gqakit.not_the_record")


@pytest.mark.parametrize("case", ["phi3-partial-rotary", "llama-biases"])
def test_without_a_record_the_lost_facts_come_from_llama_cpps_keys(tmp_path, unrecorded, case) -> None:
    family, overrides, _ = LOST[case]
    src = make_checkpoint(tmp_path, family, 2, **overrides)
    back, _ = _read_back(export_gguf(src, tmp_path / "m.gguf", "f32", progress=False).path, tmp_path / "b")
    torch.testing.assert_close(_logits(back), _logits(src), rtol=0, atol=0)


# llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) at the 27B layer counts (46
# gemma2, 62 gemma3): with head_dim 32 and hidden/heads 64/4 = 16 the two rules differ
LLAMA_CPP_SCALE = [("gemma3_text", 2, 32), ("gemma2", 2, 32), ("gemma2", 46, 16)]


@pytest.mark.parametrize("family,layers,scalar", LLAMA_CPP_SCALE)
def test_without_a_record_gemma_scales_attention_as_llama_cpp_does(
    tmp_path, unrecorded, family: str, layers: int, scalar: int
) -> None:
    src = make_checkpoint(tmp_path, family, 2, head_dim=32, layers=layers)
    config = gguf_config(export_gguf(src, tmp_path / "m.gguf", "f32", progress=False).path)
    assert config.query_pre_attn_scalar == scalar  # transformers alone: 256


def test_without_a_record_biases_llama_cannot_hold_are_refused(tmp_path, unrecorded) -> None:
    src = make_checkpoint(tmp_path, "llama", 2, attention_bias=True)
    weights = load_file(src / "model.safetensors")
    # q/k/v biases without an o_proj bias, as Qwen has them: LlamaConfig has one flag for all four
    save_file({k: v for k, v in weights.items() if not k.endswith("o_proj.bias")}, src / "model.safetensors")
    r = export_gguf(src, tmp_path / "m.gguf", "f32", progress=False)
    with pytest.raises(GqakitError, match="biases on attn_q, attn_k, attn_v but not.*attention_bias"):
        deq.dequantize_gguf(r.path, tmp_path / "back")


def test_a_copy_dequantized_by_an_older_reader_is_not_reused(tmp_path: Path, monkeypatch) -> None:
    """Copies cached before the config repairs were made without them: the reader's version in the
    cached folder's name keeps them from being opened again."""
    monkeypatch.setenv("GQAKIT_CACHE", str(tmp_path / "cache"))
    src = make_checkpoint(tmp_path, "llama", 2, attention_bias=True)
    r = export_gguf(src, tmp_path / "m.gguf", "f32", progress=False)
    old = cache_root() / deq.CACHE / f"{r.path.stem}-{fingerprint(r.path)}"
    old.mkdir(parents=True)
    (old / "config.json").write_text(json.dumps({"model_type": "llama", "attention_bias": False}))
    fresh = deq.dequantized_gguf(r.path)
    assert fresh != old and json.loads((fresh / "config.json").read_text())["attention_bias"] is True
