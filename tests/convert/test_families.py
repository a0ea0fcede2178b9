"""GPT-2, OPT and GPT-NeoX converted into stock classes that hold fewer K/V heads: exact at G = H, loadable
with the smaller KV cache at G < H, refused by name where the mapping cannot be exact."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner
from tiny_models import save_tiny_model
from transformers import AutoModelForCausalLM, DynamicCache

from gqakit.checkpoint import SAFE_INDEX
from gqakit.cli import main
from gqakit.eval.decode import cache_kwarg
from gqakit.eval.kv_bytes import measured_kv_bytes
from gqakit.safetensors_io import SafetensorsFile

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
            out = model(IDS, use_cache=True, **{cache_kwarg(): cache})
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
    # inspect runs convert's checks, the weights' included: it does not promise a phi it cannot write
    res = CliRunner().invoke(main, ["inspect", str(src)])
    assert res.exit_code == 0, res.output
    assert "converts into     nothing: input_layernorm.weight has a zero in layer(s) [1]" in res.output
    assert "not supported by convert" in res.output


def test_bigcode_targets_hold_only_mqa_or_mha(tmp_path):
    src = _model(tmp_path, "gpt2")
    res = _convert(src, tmp_path / "out", "--groups", "2")
    assert res.exit_code == 2
    assert "--groups 2: gpt_bigcode holds only G = 1 (multi_query) or G = 4 heads" in res.output
    assert not (tmp_path / "out").exists()


def test_bigcode_targets_take_every_refinement_target(tmp_path):
    """gpt_bigcode converts through the generic layer-by-layer path, so the layer-corrective target (the
    best preset's) refines a GPT-2 too."""
    src = _model(tmp_path, "gpt2")
    calib = ["--calib-data", str(_calib_text(tmp_path)), "--calib-tokens", "1024"]
    args = ["-g", "1", "--method", "calibrated", *calib, "--refine-steps", "5"]
    res = _convert(src, tmp_path / "out", *args, "--set", "refine_target=layer-corrective")
    assert res.exit_code == 0, res.output
    rec = json.loads((tmp_path / "out" / "gqakit.json").read_text())["refine"]
    assert rec["target"] == "layer-corrective" and len(rec["attention_error"]) == 2
    assert _logits(tmp_path / "out")[1].config.multi_query is True


def _related_heads(src, family: str) -> None:
    """Make every K head of each layer a linear map of head 0's (k_h = A_h k_0, biases too), and every V
    head likewise: one K/V head then holds all they say, so a calibrated MQA merge is exact where mean
    pooling is not."""
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    heads, hidden = 4, 64
    d = hidden // heads
    for i in range(2):
        w, b = state[f"transformer.h.{i}.attn.c_attn.weight"], state[f"transformer.h.{i}.attn.c_attn.bias"]
        for part in (1, 2):  # k, v (GPT-2's Conv1D: columns q | k | v, heads within)
            base = part * hidden
            w0, b0 = w[:, base : base + d].clone(), b[base : base + d].clone()
            for h in range(1, heads):
                a = torch.eye(d) + 0.3 * torch.randn(d, d, generator=gen)
                w[:, base + h * d : base + (h + 1) * d] = w0 @ a.T
                b[base + h * d : base + (h + 1) * d] = b0 @ a.T
    save_file(state, src / "model.safetensors", {"format": "pt"})


def _calib_text(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 37} token{i % 11}." for i in range(3000)))
    return text


def test_gpt2_calibrated_mqa_is_exact_where_one_head_holds_everything(tmp_path):
    src = _model(tmp_path, "gpt2")
    _related_heads(src, "gpt2")
    calib = ["--calib-data", str(_calib_text(tmp_path)), "--calib-tokens", "1024"]
    assert _convert(src, tmp_path / "mean", "-g", "1").exit_code == 0
    res = _convert(src, tmp_path / "cal", "-g", "1", "--method", "calibrated", *calib)
    assert res.exit_code == 0, res.output
    want, _ = _logits(src)
    got, model = _logits(tmp_path / "cal")
    assert model.config.multi_query is True
    assert (got - want).abs().max().item() < 1e-4
    mean, _ = _logits(tmp_path / "mean")
    assert (mean - want).abs().max().item() > 1e-2  # mean pooling is not exact here
    prov = json.loads((tmp_path / "cal" / "gqakit.json").read_text())
    assert prov["method"] == "calibrated" and len(prov["reconstruction_error"]) == 2
    assert all(e["key"] < 1e-6 and e["value"] < 1e-6 for e in prov["reconstruction_error"])


def test_gpt2_and_opt_refine_towards_the_original(tmp_path):
    for family in ("gpt2", "opt"):
        src = _model(tmp_path, family)
        calib = ["--calib-data", str(_calib_text(tmp_path)), "--calib-tokens", "2048"]
        res = _convert(src, tmp_path / f"{family}-ref", "-g", "1", *calib, "--refine-steps", "40")
        assert res.exit_code == 0, res.output
        assert _convert(src, tmp_path / f"{family}-mean", "-g", "1").exit_code == 0
        rec = json.loads((tmp_path / f"{family}-ref" / "gqakit.json").read_text())["refine"]
        assert len(rec["attention_error"]) == 2 and rec["tokens"] + rec["heldout_tokens"] == 2048
        assert all(e["heldout_after"] <= e["heldout_before"] for e in rec["attention_error"])
        assert any(e["best_step"] > 0 for e in rec["attention_error"])
        # closer to the original's next-token distribution than the mean-pooled start it refined
        want = _logits(src)[0].log_softmax(-1)
        kl = {}
        for kind in ("ref", "mean"):
            got = _logits(tmp_path / f"{family}-{kind}")[0].log_softmax(-1)
            kl[kind] = float((want.exp() * (want - got)).sum(-1).mean())
        assert kl["ref"] < kl["mean"], (family, kl)


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


def _edit_config(path, edit) -> None:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    edit(config)
    config_file.write_text(json.dumps(config, indent=2))


def test_a_tied_neox_stays_tied_in_phi_with_the_same_logits(tmp_path):
    """A tied GPT-NeoX stores no embed_out; phi ties its lm_head weight to the embedding the same way."""
    src = _model(tmp_path, "gpt_neox", tie_word_embeddings=True)
    assert "embed_out.weight" not in SafetensorsFile(src / "model.safetensors").tensors
    want, _ = _logits(src)
    for groups in (4, 2):
        out = tmp_path / f"g{groups}"
        res = _convert(src, out, "--groups", str(groups))
        assert res.exit_code == 0, res.output
        assert "lm_head.weight" not in SafetensorsFile(out / "model.safetensors").tensors
        got, model = _logits(out)
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        if groups == 4:
            assert (got - want).abs().max().item() < 1e-4
        assert torch.isfinite(got).all()


def test_a_legacy_rope_scaling_carries_over_to_phi(tmp_path):
    """A config saved before transformers 5: rotary_pct/rotary_emb_base and rope_scaling with ``type``,
    which transformers reads as rope_parameters."""
    src = _model(tmp_path, "gpt_neox")

    def legacy(config):
        config.pop("rope_parameters")
        config.update(rotary_pct=0.25, rotary_emb_base=5000.0, rope_scaling={"type": "linear", "factor": 4.0})

    _edit_config(src, legacy)
    res = _convert(src, tmp_path / "out", "--groups", "4")
    assert res.exit_code == 0, res.output
    ids = torch.randint(3, 300, (1, 96), generator=torch.Generator().manual_seed(0))
    (want, _), (got, model) = _logits(src, ids), _logits(tmp_path / "out", ids)
    rope = model.config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("linear", 4.0, 5000.0)
    assert (got - want).abs().max().item() < 1e-4


def test_retargeted_provenance_hashes_the_users_source_files(tmp_path):
    """Not the MHA rewrite's (a temporary directory): the user's config.json and shard index."""
    src = _model(tmp_path, "gpt_neox", max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()
    res = _convert(src, tmp_path / "out", "--groups", "2")
    assert res.exit_code == 0, res.output
    prov = json.loads((tmp_path / "out" / "gqakit.json").read_text())
    for key, name in (("source_config_sha256", "config.json"), ("source_index_sha256", SAFE_INDEX)):
        assert prov[key] == hashlib.sha256((src / name).read_bytes()).hexdigest(), key


def test_bigcode_output_dtype_also_rewrites_a_legacy_torch_dtype(tmp_path):
    src = _model(tmp_path, "gpt2")
    _edit_config(src, lambda config: config.update(torch_dtype=config.pop("dtype")))
    res = _convert(src, tmp_path / "out", "-g", "1", "--dtype", "bfloat16")
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_a_bigcode_output_records_the_hashes_of_its_source(tmp_path, family):
    src = _model(tmp_path, family)
    res = _convert(src, tmp_path / "out", "-g", "1")
    assert res.exit_code == 0, res.output
    prov = json.loads((tmp_path / "out" / "gqakit.json").read_text())
    assert prov["source_config_sha256"] == hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
    assert prov["source_file_sha256"] is None and prov["source_index_sha256"] is None
