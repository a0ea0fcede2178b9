"""The adapter registry is the one place per-family facts live: tensor names, key norms, partial rotary."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

from gqakit.convert.layerwise import qk_parameters
from gqakit.convert.merge_fit import keys_normalized
from gqakit.errors import GqakitError
from gqakit.families import ADAPTERS, get_adapter, rotary_dims


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
    assert rotary_dims({"model_type": "phi", "partial_rotary_factor": 0.5}, 64) == 32
    stablelm = {"model_type": "stablelm", "rope_parameters": {"partial_rotary_factor": 0.25}}
    assert rotary_dims(stablelm, 64) == 16
    # llama rotates all of head_dim whatever a stray config key says
    assert rotary_dims({"model_type": "llama", "partial_rotary_factor": 0.5}, 64) == 64
    # head_dim defaults to the config's; a family gqakit has no adapter for reads the factor
    gpt_bigcode = {"model_type": "gpt_bigcode", "hidden_size": 64, "num_attention_heads": 2}
    assert rotary_dims({**gpt_bigcode, "partial_rotary_factor": 0.5}) == 16


def test_phi3_rotates_only_its_partial_rotary_factor():
    """Phi3Config keeps partial_rotary_factor in rope_parameters; transformers rotates that share of each
    head (Phi3RotaryEmbedding), so the calibrated key merge must pair only those channels."""
    config = {"model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}
    assert rotary_dims(config, 16) == 8
    assert rotary_dims({"model_type": "phi3", "rope_parameters": {"rope_type": "default"}}, 16) == 16


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


def test_every_family_fact_is_read_from_the_one_registry():
    """No module outside gqakit/families.py (and the GGUF layouts its entries hold) asks which family it
    holds: a new family is one entry, not a branch in each command."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    branch = re.compile(
        r"model_type\"?\)?\]? *(==|!=|in |not in )|\"(falcon|gpt2|gpt_neox|opt|gpt_bigcode)\" *(==|!=|in )"
    )
    allowed = {root / "gqakit" / "families.py"}
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for folder in ("gqakit", "convert", "eval", "uptrain", "pipelines")
        for path in sorted((root / folder).rglob("*.py"))
        if path not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if branch.search(line) and "MODEL_FOR_CAUSAL_LM" not in line
    ]
    assert not found, "\n".join(found)


def test_falcon_and_bigcode_state_their_kv_heads_in_their_entries():
    from gqakit.families import family_of
    from gqakit.geometry import AttentionGeometry

    base = dict(hidden_size=64, num_attention_heads=8, num_hidden_layers=2)
    new = dict(base, model_type="falcon", new_decoder_architecture=True, num_kv_heads=2)
    old = dict(base, model_type="falcon", new_decoder_architecture=False)
    assert AttentionGeometry.from_config(new).num_kv_heads == 2
    assert AttentionGeometry.from_config(old).num_kv_heads == 1  # FalconConfig's multi_query default
    assert family_of(new).cached_kv_heads(new, 2, 8) == 8  # transformers caches H
    assert family_of(old).cached_kv_heads(old, 1, 8) == 1
    bigcode = dict(model_type="gpt_bigcode", n_embd=64, n_head=8, n_layer=2, multi_query=True)
    assert AttentionGeometry.from_config(bigcode).num_kv_heads == 1
    assert family_of("no-such-family").weight_kv_heads({"num_key_value_heads": 2}, 8) == 2


def test_unsupported_and_unknown_families_say_why():
    with pytest.raises(GqakitError, match="Falcon's transformers attention ties K/V heads"):
        get_adapter("falcon")
    with pytest.raises(GqakitError, match='Did you mean "llama"'):
        get_adapter("lama")
