"""GPT-2, OPT and GPT-NeoX converted into stock classes that hold fewer K/V heads: exact at G = H, loadable
with the smaller KV cache at G < H, refused by name where the mapping cannot be exact."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, DynamicCache

from gqakit.cli import main
from gqakit.eval.kv_bytes import measured_kv_bytes
from gqakit.testing import save_tiny_model

IDS = torch.tensor([[5, 9, 17, 3, 22, 41, 8, 13, 2, 30, 11, 7]])

FAMILIES = {
    "gpt2": dict(activation_function="gelu_new"),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, activation_function="relu"),
    # partial rotary (a quarter of head_dim 16 = 4 channels), its own base, biases everywhere
    "gpt_neox": dict(rotary_pct=0.25, rotary_emb_base=5000.0, hidden_act="gelu", use_parallel_residual=True),
}


def _model(tmp_path, family: str, seed: int = 0, **overrides):
    return save_tiny_model(tmp_path / family, family, seed=seed, **{**FAMILIES[family], **overrides})


def _convert(src, dst, *args: str):
    return CliRunner().invoke(main, ["convert", str(src), str(dst), *args])


def _logits(path, ids=IDS):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits, model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_groups_equal_heads_gives_the_same_logits(tmp_path, family):
    src = _model(tmp_path, family)
    res = _convert(src, tmp_path / "out", "--groups", "4")
    assert res.exit_code == 0, res.output
    want, _ = _logits(src)
    got, model = _logits(tmp_path / "out")
    target = {"gpt2": "gpt_bigcode", "opt": "gpt_bigcode", "gpt_neox": "phi"}[family]
    assert model.config.model_type == target
    assert (got - want).abs().max().item() < 1e-4
    prov = json.loads((tmp_path / "out" / "gqakit.json").read_text())
    assert prov["retargeted"] == {"from": family, "to": target}


@pytest.mark.parametrize(("family", "groups"), [("gpt2", 1), ("opt", 1), ("gpt_neox", 2), ("gpt_neox", 1)])
def test_fewer_groups_load_in_transformers_with_a_smaller_kv_cache(tmp_path, family, groups):
    src = _model(tmp_path, family)
    res = _convert(src, tmp_path / "out", "--groups", str(groups))
    assert res.exit_code == 0, res.output
    sizes = {}
    for name, path in (("src", src), ("out", tmp_path / "out")):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(IDS, past_key_values=cache, use_cache=True)
        assert torch.isfinite(out.logits).all()
        sizes[name] = measured_kv_bytes(out.past_key_values)
    assert sizes["src"] == sizes["out"] * (4 // groups)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    if family == "gpt_neox":
        assert config["num_key_value_heads"] == groups
    else:
        assert config["multi_query"] is True


def test_neox_calibrated_merge_runs_on_the_phi_target(tmp_path):
    src = _model(tmp_path, "gpt_neox")
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 37} token{i % 11}." for i in range(3000)))
    res = _convert(
        src, tmp_path / "out", "--groups", "2", "--method", "calibrated", "--calib-data", str(text),
        "--calib-tokens", "512",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    got, model = _logits(tmp_path / "out")
    assert model.config.num_key_value_heads == 2 and torch.isfinite(got).all()


@pytest.mark.parametrize(
    ("family", "overrides", "fragments"),
    [
        ("opt", dict(do_layer_norm_before=False), ["do_layer_norm_before is false", "post-LN"]),
        ("opt", dict(word_embed_proj_dim=32), ["word_embed_proj_dim 32 != hidden_size 64"]),
        ("gpt_neox", dict(use_parallel_residual=False), ["use_parallel_residual is false"]),
        ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), ["scale_attn_by_inverse_layer_idx"]),
        ("gpt2", dict(reorder_and_upcast_attn=True), ["reorder_and_upcast_attn"]),
    ],
)
def test_variants_the_mapping_cannot_hold_are_refused_by_name(tmp_path, family, overrides, fragments):
    src = _model(tmp_path, family, **overrides)
    res = _convert(src, tmp_path / "out", "--groups", "1")
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "cannot be converted exactly" in res.output
    for fragment in fragments:
        assert fragment in res.output
    assert not (tmp_path / "out").exists()


def test_zero_layernorm_gain_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    src = _model(tmp_path, "gpt_neox")
    state = load_file(src / "model.safetensors")
    state["gpt_neox.layers.1.input_layernorm.weight"][3] = 0.0
    save_file(state, src / "model.safetensors", {"format": "pt"})
    res = _convert(src, tmp_path / "out", "--groups", "2")
    assert res.exit_code == 2 and "input_layernorm.weight has a zero in layer(s) [1]" in res.output
    assert not (tmp_path / "out").exists()


def test_bigcode_targets_hold_only_mqa_or_mha(tmp_path):
    src = _model(tmp_path, "gpt2")
    res = _convert(src, tmp_path / "out", "--groups", "2")
    assert res.exit_code == 2
    assert "--groups 2: gpt_bigcode holds only G = 1 (multi_query) or G = 4 heads" in res.output
    text = tmp_path / "calib.txt"
    text.write_text("some words " * 400)
    res = _convert(src, tmp_path / "out", "-g", "1", "--method", "calibrated", "--calib-data", str(text))
    assert res.exit_code == 2 and "takes the pooling methods only" in res.output
    assert not (tmp_path / "out").exists()


def test_inspect_says_which_class_the_output_will_be_and_why(tmp_path):
    src = _model(tmp_path, "gpt2")
    res = CliRunner().invoke(main, ["inspect", str(src)])
    assert res.exit_code == 0, res.output
    assert "converts into     gpt_bigcode: GPTBigCode is GPT-2's block" in res.output
    assert "G=1 " in res.output and "G=4 " in res.output and "G=2 " not in res.output
    bad = _model(tmp_path / "post-ln", "opt", do_layer_norm_before=False)
    res = CliRunner().invoke(main, ["inspect", str(bad)])
    assert "not supported by convert" in res.output and "nothing: do_layer_norm_before is false" in res.output


def test_geometry_reads_gpt2_style_configs_and_multi_query(tmp_path):
    from gqakit.geometry import AttentionGeometry

    src = _model(tmp_path, "gpt2")
    assert _convert(src, tmp_path / "mqa", "-g", "1").exit_code == 0
    geom = AttentionGeometry.from_config(json.loads((tmp_path / "mqa" / "config.json").read_text()))
    assert (geom.num_layers, geom.hidden_size, geom.num_heads, geom.num_kv_heads) == (2, 64, 4, 1)


def test_bigcode_output_takes_the_dtype_asked_for(tmp_path):
    src = _model(tmp_path, "gpt2")
    res = _convert(src, tmp_path / "out", "-g", "1", "--dtype", "bfloat16")
    assert res.exit_code == 0, res.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.bfloat16
