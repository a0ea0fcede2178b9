"""llama.cpp (through llama-cpp-python) loads the exported files and computes what transformers does.

Marked slow and skipped without the binding: ``pip install llama-cpp-python`` builds llama.cpp from
source. The KV cache is kept in float32 (``type_k``/``type_v``), so an f32 export is compared with
transformers' float32 forward at float32 rounding; llama.cpp's default f16 cache alone moves logits by
~1e-4. Measured max |logit difference| (f32 cache), the bounds below leave headroom over them:

* llama, mistral, qwen2, phi3 (SiLU MLPs): ~2e-7 on logits of magnitude ~0.6;
* gemma: ~7e-6; gemma2, gemma3: ~2e-4. ggml's CPU GELU reads an f16 lookup table, and the gemma2/3
  post-norms rescale the small block outputs of a random tiny model to unit size, magnifying it
  (rounding GELU through f16 in transformers brings gemma3 to ~7e-6);
* SmolLM2-135M: ~8e-5 on logits of magnitude ~30.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_helpers import FAMILIES, FORMS

from gqakit.gguf.export import export_gguf
from gqakit.storage import cache_root

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow

IDS = list(range(3, 60, 4))  # 15 tokens inside every tiny vocabulary
F32 = 0  # GGML_TYPE_F32, for the KV cache
TOLERANCE = {"gemma": 5e-5, "gemma2": 1e-3, "gemma3_text": 1e-3}  # others: 1e-5
SMOLLM = cache_root() / "smollm2-135m" / "model"  # read at collection: the user's cache


def llama_cpp_logits(path: Path, ids: list[int], f32_cache: bool = True) -> np.ndarray:
    kv = {"type_k": F32, "type_v": F32} if f32_cache else {}
    model = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=256, verbose=False, **kv)
    try:
        model.eval(ids)
        return np.array(model.scores[: len(ids)])
    finally:
        model.close()


def transformers_logits(src: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("family,form", [(f, form) for f in FAMILIES for form in FORMS])
def test_f32_logits_equal_transformers(exported, family: str, form: str) -> None:
    src, r = exported(family, form, "f32")
    diff = np.abs(llama_cpp_logits(r.path, IDS) - transformers_logits(src, IDS)).max()
    assert diff < TOLERANCE.get(family, 1e-5), f"{family} {form}: max |logit difference| {diff:.2e}"


@pytest.mark.parametrize("out_type,bound", [("f16", 5e-3), ("q8_0", 3e-2)])
def test_stored_types_stay_close(exported, out_type: str, bound: float) -> None:
    # llama.cpp also rounds activations for f16/q8_0 matrix products: bounds relative to the logits
    src, r = exported("llama", "gqa", out_type)
    ref = transformers_logits(src, IDS)
    assert np.abs(llama_cpp_logits(r.path, IDS) - ref).max() < bound * np.abs(ref).max()


def test_q8_0_is_bitwise_what_llama_cpp_quantizes(exported, tmp_path: Path) -> None:
    import ctypes

    import gguf

    _, f32 = exported("gemma3_text", "mqa", "f32")
    _, ours = exported("gemma3_text", "mqa", "q8_0")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    theirs = tmp_path / "llama-quantize.gguf"
    assert (
        llama_cpp.llama_model_quantize(str(f32.path).encode(), str(theirs).encode(), ctypes.byref(params))
        == 0
    )
    a = {t.name: t for t in gguf.GGUFReader(ours.path).tensors}
    b = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name


def test_llama_with_attention_biases_matches(tmp_path: Path) -> None:
    from tiny_models import save_tiny_model

    src = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=1, attention_bias=True)
    r = export_gguf(src, tmp_path / "m.gguf", "f32")
    assert np.abs(llama_cpp_logits(r.path, IDS) - transformers_logits(src, IDS)).max() < 1e-5


def test_llama3_rope_scaling_matches(tmp_path: Path) -> None:
    from tiny_models import save_tiny_model

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 10000.0}  # fmt: skip
    src = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2, rope_parameters=rope)
    r = export_gguf(src, tmp_path / "m.gguf", "f32")
    ids = list(range(3, 380, 5))  # 76 positions, past the original context
    assert np.abs(llama_cpp_logits(r.path, ids) - transformers_logits(src, ids)).max() < 1e-5


TEXTS = [
    "Hello world, rivers carry sand.",
    "The old library kept maps\n of  coasts 123 4567 ZZ!",
    "  leading spaces, tabs\tand ünïcödé 🚀 text",
]


@pytest.mark.parametrize(
    "family,tokenizer", [("llama", "bpe"), ("qwen2", "bpe"), ("gemma2", "spm"), ("llama", "spm-prefix")]
)
def test_tokenization_equals_transformers(exported, family: str, tokenizer: str) -> None:
    from transformers import AutoTokenizer

    src, r = exported(family, "gqa", "f32", tokenizer)
    hf = AutoTokenizer.from_pretrained(src)
    model = llama_cpp.Llama(model_path=str(r.path), vocab_only=True, verbose=False)
    try:
        add_bos = model.metadata.get("tokenizer.ggml.add_bos_token") == "true"
        for text in TEXTS:
            assert model.tokenize(text.encode(), add_bos=add_bos, special=False) == hf(text)["input_ids"], (
                text
            )
    finally:
        model.close()


@pytest.mark.skipif(not SMOLLM.is_dir(), reason=f"SmolLM2-135M is not cached in {SMOLLM.parent.parent}")
def test_smollm2_f32_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    r = export_gguf(SMOLLM, tmp_path / "smollm2.gguf", "f32")
    assert r.tokenizer == "gpt2/gpt-2"
    text = "The quick brown fox jumps over the lazy dog. In 2024, 12345 people visited Paris!\n  Indented."
    ids = AutoTokenizer.from_pretrained(SMOLLM)(text)["input_ids"]
    ref = transformers_logits(SMOLLM, ids)
    got = llama_cpp_logits(r.path, ids)
    assert np.abs(got - ref).max() < 1e-3
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    model = llama_cpp.Llama(model_path=str(r.path), vocab_only=True, verbose=False)
    try:
        assert model.tokenize(text.encode(), add_bos=False, special=False) == ids
    finally:
        model.close()


@pytest.mark.parametrize("groups", [2, 1])
def test_gpt_neox_converted_to_phi_runs_in_llama_cpp_with_fewer_kv_heads(tmp_path: Path, groups: int) -> None:
    # GPT-NeoX (Pythia) converts into phi, which llama.cpp runs as phi2, reading the K/V head count
    from tiny_models import save_tiny_model

    from gqakit.convert import ConvertOptions, convert_checkpoint

    src = save_tiny_model(tmp_path / "neox", "gpt_neox", rotary_pct=0.25)
    convert_checkpoint(src, tmp_path / "phi", ConvertOptions(groups=groups))
    r = export_gguf(tmp_path / "phi", tmp_path / "phi.gguf", "f32")
    assert r.arch == "phi2" and r.num_kv_heads == groups
    diff = np.abs(llama_cpp_logits(r.path, IDS) - transformers_logits(tmp_path / "phi", IDS)).max()
    assert diff < 2e-4, f"max |logit difference| {diff:.2e}"  # measured ~3e-5 (GELU via an f16 table)


@pytest.mark.parametrize("groups", [1, 4])
def test_gpt2_converted_to_gpt_bigcode_runs_in_llama_cpp(tmp_path: Path, groups: int) -> None:
    # GPT-2 converts into gpt_bigcode, which llama.cpp runs as starcoder, reading the K/V head count
    from tiny_models import save_tiny_model

    from gqakit.convert import ConvertOptions, convert_checkpoint

    src = save_tiny_model(tmp_path / "gpt2", "gpt2")
    convert_checkpoint(src, tmp_path / "bigcode", ConvertOptions(groups=groups))
    r = export_gguf(tmp_path / "bigcode", tmp_path / "bigcode.gguf", "f32")
    assert r.arch == "starcoder" and r.num_kv_heads == groups
    diff = np.abs(llama_cpp_logits(r.path, IDS) - transformers_logits(tmp_path / "bigcode", IDS)).max()
    assert diff < 2e-4, f"max |logit difference| {diff:.2e}"
