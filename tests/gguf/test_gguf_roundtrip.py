"""GGUF -> gqakit's GGUF reading (transformers dequantizes it) -> checkpoint -> export -> the same GGUF,
and GGUF -> ``gqakit convert`` -> GGUF with pooled K/V heads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf_helpers import ggml_to_hf_rotary, read_gguf

from gqakit.gguf.export import export_gguf
from gqakit.gguf.header import RECORDED_CONFIG

# Keys that name where a file came from, which a round trip changes by design.
_PROVENANCE = ("general.name",)
CASES = [
    ("llama", "mha", "bpe"), ("llama", "gqa", "bpe"), ("llama", "mqa", "bpe"), ("mistral", "gqa", "bpe"),
    ("qwen2", "gqa", "bpe"), ("phi3", "mqa", "bpe"),
    # SentencePiece-style vocabularies, as real gemma and llama-2 models have
    ("llama", "gqa", "spm-prefix"), ("gemma2", "mqa", "spm"), ("gemma3_text", "gqa", "spm"),
]  # fmt: skip
# transformers reads no gemma (v1) GGUF ("architecture gemma is not supported yet"), so gqakit's GGUF
# input cannot round-trip that family.


@pytest.mark.parametrize("family,form,tokenizer", CASES)
def test_gguf_checkpoint_gguf(exported, tmp_path: Path, family: str, form: str, tokenizer: str) -> None:
    _, first = exported(family, form, "f32", tokenizer)
    second = export_gguf(first.path, tmp_path / "again.gguf", "f32")
    v1, i1, m1 = read_gguf(first.path)
    v2, i2, m2 = read_gguf(second.path)
    assert i1 == i2
    for name in v1:
        np.testing.assert_array_equal(v2[name], v1[name], err_msg=name)
    scores1 = m1.pop("tokenizer.ggml.scores", None)
    scores2 = m2.pop("tokenizer.ggml.scores", None)
    for key in _PROVENANCE:
        m1.pop(key, None), m2.pop(key, None)
    r1, r2 = json.loads(m1.pop(RECORDED_CONFIG)), json.loads(m2.pop(RECORDED_CONFIG))
    assert m1 == m2
    # the checkpoint read back keeps every recorded fact of the first: a mistral reads back as llama (the
    # architecture both export to), which has no sliding window; the file adds its tokenizer's unk id
    if family != "mistral":
        assert r1.keys() <= r2.keys() <= r1.keys() | {"unk_token_id"}
    same = r1.keys() & r2.keys() - {"architectures", "model_type"}
    assert {k: r2[k] for k in same} == {k: r1[k] for k in same}
    if scores1 is not None:
        # transformers rebuilds merges from the scores, with different gaps: the order is what counts
        s1, s2 = np.array(scores1), np.array(scores2)
        assert ((s1 < 0) == (s2 < 0)).all()
        assert (np.argsort(-s1, kind="stable") == np.argsort(-s2, kind="stable")).all()


def test_gguf_convert_gguf_pools_the_heads(exported, tmp_path: Path, monkeypatch) -> None:
    """An MHA GGUF converted by gqakit to 2 K/V heads and exported again holds the mean of each pair of
    K heads, in llama.cpp's row order."""
    monkeypatch.setenv("GQAKIT_CACHE", str(tmp_path / "cache"))  # the dequantized copy goes there
    from gqakit.convert.api import ConvertOptions, convert_checkpoint

    _, mha = exported("llama", "mha", "f32")
    convert_checkpoint(mha.path, tmp_path / "gqa", ConvertOptions(groups=2, method="mean"))
    gqa = export_gguf(tmp_path / "gqa", tmp_path / "gqa.gguf", "f32")
    v_mha, _, _ = read_gguf(mha.path)
    v_gqa, _, m_gqa = read_gguf(gqa.path)
    assert m_gqa["llama.attention.head_count_kv"] == 2 and m_gqa["llama.attention.head_count"] == 4
    import torch

    for kind in ("attn_k", "attn_v"):
        w4 = torch.from_numpy(v_mha[f"blk.1.{kind}.weight"])
        w2 = torch.from_numpy(v_gqa[f"blk.1.{kind}.weight"])
        if kind == "attn_k":  # back to HF's row order to pool whole heads, as convert does
            w4, w2 = ggml_to_hf_rotary(w4, 4), ggml_to_hf_rotary(w2, 2)
        pooled = w4.view(2, 2, -1, w4.shape[-1]).mean(1).reshape(w2.shape)
        torch.testing.assert_close(w2, pooled)
    np.testing.assert_array_equal(v_gqa["blk.1.attn_q.weight"], v_mha["blk.1.attn_q.weight"])
