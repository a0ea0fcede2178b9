"""The adapter registry is the one place per-family facts live: tensor names, key norms, partial rotary."""

from __future__ import annotations

import pytest

from gqakit.convert.layerwise_blocks import qk_parameters
from gqakit.convert.merge_fit import keys_normalized, rotary_dim
from gqakit.convert.registry import ADAPTERS, get_adapter
from gqakit.errors import GqakitError
from gqakit.testing import tiny_model


def test_tensor_names_the_key_and_raises_naming_a_missing_role():
    llama = get_adapter("llama")
    assert llama.tensor("o", 3) == "model.layers.3.self_attn.o_proj.weight"
    assert llama.tensor("k", 0, "bias") == "model.layers.0.self_attn.k_proj.bias"
    assert llama.module("qkv", 0) is None
    with pytest.raises(GqakitError, match=r"llama adapter has no 'qkv' module \(layer 2\)"):
        llama.tensor("qkv", 2)
    assert get_adapter("phi3").key_input(1) == "model.layers.1.self_attn.qkv_proj"
    assert llama.key_input(1) == "model.layers.1.self_attn.k_proj"


@pytest.mark.parametrize(
    ("family", "tensor", "expected"),
    [
        ("qwen3", "model.layers.0.self_attn.k_norm.weight", True),
        ("olmo2", "model.layers.0.self_attn.k_norm.weight", True),
        ("stablelm", "model.layers.0.self_attn.k_layernorm.norms.0.weight", True),
        # phi's qk_layernorm: one LayerNorm over head_dim, shared by the key heads
        ("phi", "model.layers.0.self_attn.k_layernorm.weight", True),
        ("phi", "model.layers.0.self_attn.k_proj.weight", False),
        # stablelm's qk_layernorm is a config switch: without the modules its keys are linear
        ("stablelm", "model.layers.0.self_attn.k_proj.weight", False),
        # a module named like another family's key norm is not one for llama
        ("llama", "model.layers.0.self_attn.k_norm.weight", False),
    ],
)
def test_keys_normalized_reads_the_adapters_key_norm_roles(family, tensor, expected):
    assert keys_normalized({tensor: None}, ADAPTERS[family], 0) is expected


def test_partial_rotary_is_read_only_for_families_that_have_it():
    config = {"partial_rotary_factor": 0.5}
    assert rotary_dim(config, get_adapter("phi"), 64) == 32
    assert rotary_dim({"rope_parameters": {"partial_rotary_factor": 0.25}}, get_adapter("stablelm"), 64) == 16
    # llama rotates all of head_dim whatever a stray config key says
    assert rotary_dim(config, get_adapter("llama"), 64) == 64


def test_phi3_rotates_only_its_partial_rotary_factor():
    """Phi3Config keeps partial_rotary_factor in rope_parameters; transformers rotates that share of each
    head (Phi3RotaryEmbedding), so the calibrated key merge must pair only those channels."""
    config = {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}
    assert rotary_dim(config, get_adapter("phi3"), 16) == 8
    assert rotary_dim({"rope_parameters": {"rope_type": "default"}}, get_adapter("phi3"), 16) == 16


@pytest.mark.parametrize(
    ("family", "kw"),
    [
        ("qwen3", {}),
        ("gemma3_text", {"head_dim": 16}),
        ("olmo2", {}),
        ("phi", {"qk_layernorm": True}),
        ("stablelm", {"qk_layernorm": True}),  # one norm module per head
        ("llama", {}),
    ],
)
def test_qk_parameters_are_the_query_and_key_projections_and_all_their_norms(family, kw):
    """--refine-qk-lr covers "q, k and their norms": every parameter of the attention block whose name
    says query or key side, and nothing else."""
    path = "model.layers.0.self_attn"
    block = tiny_model(family, heads=4, kv_heads=2, **kw).get_submodule(path)
    query_key = ("q_proj.", "k_proj.", "q_norm.", "k_norm.", "q_layernorm.", "k_layernorm.")
    want = [n for n, _ in block.named_parameters() if n.startswith(query_key)]
    assert any("norm" in n for n in want) == (family != "llama")
    assert qk_parameters(ADAPTERS[family], 0, path, block) == want
