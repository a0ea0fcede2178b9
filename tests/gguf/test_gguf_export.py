"""Export of every family in MHA, GQA and MQA form, read back with gguf-py's own reader.

Every tensor must sit under the name llama.cpp looks for and hold the Hugging Face values, after
undoing the two documented rewrites (llama-family Q/K row order, gemma's 1 + w norms); the metadata
must state the geometry the config states.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from gguf_helpers import FAMILIES, FORMS, read_gguf
from safetensors.torch import load_file

from gqakit.gguf.header import RECORDED_CONFIG

# Hugging Face module -> GGUF tensor, written out here independently of gguf-py's TensorNameMap.
_COMMON = {
    r"model\.embed_tokens": "token_embd",
    r"model\.norm": "output_norm",
    r"lm_head": "output",
    r"model\.layers\.(\d+)\.input_layernorm": "blk.{}.attn_norm",
    r"model\.layers\.(\d+)\.self_attn\.q_proj": "blk.{}.attn_q",
    r"model\.layers\.(\d+)\.self_attn\.k_proj": "blk.{}.attn_k",
    r"model\.layers\.(\d+)\.self_attn\.v_proj": "blk.{}.attn_v",
    r"model\.layers\.(\d+)\.self_attn\.o_proj": "blk.{}.attn_output",
    r"model\.layers\.(\d+)\.mlp\.gate_proj": "blk.{}.ffn_gate",
    r"model\.layers\.(\d+)\.mlp\.up_proj": "blk.{}.ffn_up",
    r"model\.layers\.(\d+)\.mlp\.down_proj": "blk.{}.ffn_down",
    r"model\.layers\.(\d+)\.post_attention_layernorm": "blk.{}.ffn_norm",
}
_POST_NORMS = {  # gemma2/gemma3: a norm after attention and one around the MLP
    r"model\.layers\.(\d+)\.post_attention_layernorm": "blk.{}.post_attention_norm",
    r"model\.layers\.(\d+)\.pre_feedforward_layernorm": "blk.{}.ffn_norm",
    r"model\.layers\.(\d+)\.post_feedforward_layernorm": "blk.{}.post_ffw_norm",
}
NAMES = {
    "llama": _COMMON,
    "mistral": _COMMON,
    "qwen2": _COMMON,
    "gemma": _COMMON,
    "gemma2": {**_COMMON, **_POST_NORMS},
    "gemma3_text": {
        **_COMMON,
        **_POST_NORMS,
        r"model\.layers\.(\d+)\.self_attn\.q_norm": "blk.{}.attn_q_norm",
        r"model\.layers\.(\d+)\.self_attn\.k_norm": "blk.{}.attn_k_norm",
    },
    "phi3": {
        **_COMMON,
        r"model\.layers\.(\d+)\.self_attn\.qkv_proj": "blk.{}.attn_qkv",  # fused q|k|v, kept fused
        r"model\.layers\.(\d+)\.mlp\.gate_up_proj": "blk.{}.ffn_up",  # fused gate|up, kept fused
    },
}
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma": "gemma", "gemma2": "gemma2",
        "gemma3_text": "gemma3", "phi3": "phi3"}  # fmt: skip
CASES = [(f, form) for f in FAMILIES for form in FORMS]


def gguf_name(family: str, hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    for pattern, target in NAMES[family].items():
        if m := re.fullmatch(pattern, module):
            return f"{target.format(*m.groups())}.{kind}"
    raise AssertionError(f"test table has no GGUF name for {hf_name}")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """GGUF llama rows back to HF order by index arithmetic: GGUF row h*d + 2i is HF row h*d + i and
    GGUF row h*d + 2i + 1 is HF row h*d + d/2 + i."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(d // 2):
            out[h * d + i] = w[h * d + 2 * i]
            out[h * d + d // 2 + i] = w[h * d + 2 * i + 1]
    return out


def expected(family: str, hf_name: str, t: torch.Tensor) -> np.ndarray:
    """The HF tensor as the GGUF must hold it (in float32)."""
    t = t.float()
    if family.startswith("gemma") and hf_name.endswith("norm.weight"):
        t = t + 1.0  # llama.cpp multiplies by the stored weight; gemma's norm by 1 + w
    return t.numpy()


def undo(family: str, cfg: dict, hf_name: str, values: np.ndarray) -> np.ndarray:
    if ARCH[family] == "llama" and ".q_proj." in hf_name:
        return unpermute_rows(values, cfg["num_attention_heads"])
    if ARCH[family] == "llama" and ".k_proj." in hf_name:
        return unpermute_rows(values, cfg["num_key_value_heads"])
    return values


@pytest.mark.parametrize("family,form", CASES)
def test_tensors_equal_the_checkpoint(exported, family: str, form: str) -> None:
    src, result = exported(family, form, "f32")
    cfg = json.loads((src / "config.json").read_text())
    hf = load_file(src / "model.safetensors")
    values, infos, _ = read_gguf(result.path)
    tied = cfg.get("tie_word_embeddings", False)
    want = {gguf_name(family, n): n for n in hf if not (tied and n == "lm_head.weight")}
    assert set(values) == set(want)
    for name, hf_name in want.items():
        got = undo(family, cfg, hf_name, values[name])
        assert got.shape == tuple(hf[hf_name].shape), name
        np.testing.assert_array_equal(got, expected(family, hf_name, hf[hf_name]), err_msg=name)
        assert infos[name][0] == "F32"
    assert result.tensors == len(want)


@pytest.mark.parametrize("family,form", CASES)
def test_metadata_states_the_geometry(exported, family: str, form: str) -> None:
    src, result = exported(family, form, "f32")
    cfg = json.loads((src / "config.json").read_text())
    _, _, meta = read_gguf(result.path)
    arch = ARCH[family]
    assert meta["general.architecture"] == arch == result.arch
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    expected_keys = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": 4,
        "attention.head_count_kv": FORMS[form],
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.dimension_count": head_dim,
        "vocab_size": cfg["vocab_size"],
    }
    for key, value in expected_keys.items():
        assert meta[f"{arch}.{key}"] == value, key
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"], rel=1e-6)
    rope = cfg["rope_parameters"]
    theta = rope["full_attention"]["rope_theta"] if family == "gemma3_text" else rope["rope_theta"]
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(theta)
    assert meta["general.file_type"] == 0  # ALL_F32
    assert not any(k.startswith("gqakit.") and k != RECORDED_CONFIG for k in meta)  # nothing else reads them


def test_family_specific_keys(exported) -> None:
    _, r = exported("gemma2", "gqa")
    meta = read_gguf(r.path)[2]
    assert meta["gemma2.attn_logit_softcapping"] == 50.0 and meta["gemma2.final_logit_softcapping"] == 30.0
    assert meta["gemma2.attention.sliding_window"] == 64
    assert "gemma2.attention.sliding_window_pattern" not in meta  # alternating, what llama.cpp assumes
    src, r = exported("gemma3_text", "gqa")
    meta = read_gguf(r.path)[2]
    assert meta["gemma3.rope.freq_base"] == 1_000_000.0 and meta["gemma3.rope.freq_base_swa"] == 10_000.0
    assert meta["gemma3.attention.sliding_window"] == 64
    _, r = exported("phi3", "mqa")
    meta = read_gguf(r.path)[2]
    assert meta["phi3.rope.scaling.original_context_length"] == 4096
    assert meta["phi3.attention.sliding_window"] == 0


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_f16_stores_matrices_rounded_and_vectors_exact(exported, family: str) -> None:
    src, r = exported(family, "gqa", "f16")
    cfg = json.loads((src / "config.json").read_text())
    hf = load_file(src / "model.safetensors")
    values, infos, meta = read_gguf(r.path)
    assert meta["general.file_type"] == 1
    for hf_name, t in hf.items():
        if cfg.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        name = gguf_name(family, hf_name)
        got = undo(family, cfg, hf_name, values[name])
        want = expected(family, hf_name, t)
        if t.dim() == 1:
            assert infos[name][0] == "F32"
            np.testing.assert_array_equal(got, want)
        else:
            assert infos[name][0] == "F16"
            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))


def test_q8_0_quantizes_whole_block_rows(exported) -> None:
    src, r = exported("llama", "mqa", "q8_0")
    hf = load_file(src / "model.safetensors")
    values, infos, meta = read_gguf(r.path)
    assert meta["general.file_type"] == 7 and meta["general.quantization_version"] == 2
    assert infos["blk.0.attn_k.weight"][0] == "Q8_0" and infos["blk.0.attn_norm.weight"][0] == "F32"
    got = unpermute_rows(values["blk.0.attn_k.weight"], 1)
    want = hf["model.layers.0.self_attn.k_proj.weight"].numpy()
    # Q8_0: one scale per 32 values, 8-bit codes -> error at most half a step of max|w| / 127
    assert np.abs(got - want).max() <= np.abs(want).max() / 127 * 0.51


def test_tokenizer_is_embedded(exported) -> None:
    src, r = exported("llama", "gqa")
    spec = json.loads((src / "tokenizer.json").read_text())
    _, _, meta = read_gguf(r.path)
    vocab = {i: t for t, i in spec["model"]["vocab"].items()}
    n = json.loads((src / "config.json").read_text())["vocab_size"]
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == n
    assert tokens[: len(vocab)] == [vocab[i] for i in range(len(vocab))]
    assert tokens[len(vocab) :] == [f"[PAD{i}]" for i in range(len(vocab), n)]  # padded to the embedding
    types = meta["tokenizer.ggml.token_type"]
    assert types[:3] == [3, 3, 3]  # <pad> <s> </s>: CONTROL
    assert set(types[3 : len(vocab)]) == {1} and set(types[len(vocab) :]) <= {5}
    assert meta["tokenizer.ggml.merges"] == [
        " ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]
    ]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert meta["tokenizer.ggml.padding_token_id"] == 0
    assert meta["tokenizer.ggml.add_bos_token"] is False and meta["tokenizer.ggml.add_eos_token"] is False
    assert r.tokenizer == "gpt2/gpt-2"


def test_llama_biases_are_permuted_like_their_rows(tmp_path) -> None:
    from tiny_models import save_tiny_model

    from gqakit.gguf.export import export_gguf

    src = save_tiny_model(tmp_path / "b", "llama", heads=4, kv_heads=2, attention_bias=True)
    values = read_gguf(export_gguf(src, tmp_path / "b.gguf").path)[0]
    hf = load_file(src / "model.safetensors")
    for proj, heads in (("q", 4), ("k", 2)):
        want = hf[f"model.layers.0.self_attn.{proj}_proj.bias"].numpy()
        np.testing.assert_array_equal(unpermute_rows(values[f"blk.0.attn_{proj}.bias"], heads), want)
    np.testing.assert_array_equal(
        values["blk.0.attn_v.bias"], hf["model.layers.0.self_attn.v_proj.bias"].numpy()
    )


def test_a_tied_phi_writes_the_output_projection_llama_cpp_requires(tmp_path) -> None:
    """llama.cpp's phi2 loader requires output.weight (no fallback to token_embd); a tied phi, such as a
    tied GPT-NeoX converted by gqakit, stores no lm_head.weight, so the embedding is written there."""
    from tiny_models import save_tiny_model

    from gqakit.convert import ConvertOptions, convert_checkpoint
    from gqakit.gguf.export import export_gguf

    src = save_tiny_model(tmp_path / "neox", "gpt_neox", heads=4, tie_word_embeddings=True)
    phi = convert_checkpoint(src, tmp_path / "phi", ConvertOptions(groups=2), progress=False).dst
    assert "lm_head.weight" not in load_file(phi / "model.safetensors")
    values = read_gguf(export_gguf(phi, tmp_path / "phi.gguf", "f32", progress=False).path)[0]
    embedding = load_file(phi / "model.safetensors")["model.embed_tokens.weight"].numpy()
    np.testing.assert_array_equal(values["output.weight"], embedding)
    assert "output.bias" in values
