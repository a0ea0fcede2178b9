"""End-to-end conversion of saved checkpoints: every family, shards, dtypes, expand, provenance."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_model
from transformers import AutoModelForCausalLM

from gqakit.convert import ADAPTERS, ConvertOptions, convert_checkpoint, expand_checkpoint, inspect_checkpoint
from gqakit.safetensors_io import SafetensorsFile

IDS = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _logits(path):
    with torch.no_grad():
        return _load(path)(IDS).logits


@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_every_family_converts_loads_and_generates(tmp_path, family):
    kw = {"head_dim": 16} if family.startswith("gemma") else {}  # gemma: head_dim != hidden / heads
    src = save_tiny_model(tmp_path / "src", family, heads=4, kv_heads=4, **kw)
    res = convert_checkpoint(src, tmp_path / "gqa", ConvertOptions(groups=2))
    assert res.to_kv_heads == 2
    model = _load(tmp_path / "gqa")
    assert model.config.num_key_value_heads == 2
    assert type(model).__name__ == type(_load(src)).__name__
    out = model.generate(IDS[:1], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, IDS.shape[1] + 4)
    # MQA too, and G = H is exact for every family.
    convert_checkpoint(src, tmp_path / "mqa", ConvertOptions(groups=1))
    assert _load(tmp_path / "mqa").config.num_key_value_heads == 1
    convert_checkpoint(src, tmp_path / "same", ConvertOptions(groups=4))
    torch.testing.assert_close(_logits(tmp_path / "same"), _logits(src), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen2", "olmo2"])
def test_expand_gives_identical_logits(tmp_path, family):
    src = save_tiny_model(tmp_path / "src", family, heads=4, kv_heads=2)
    res = expand_checkpoint(src, tmp_path / "mha")
    assert (res.from_kv_heads, res.to_kv_heads) == (2, 4)
    torch.testing.assert_close(_logits(tmp_path / "mha"), _logits(src), rtol=1e-5, atol=1e-5)
    # ...and pooling the expanded heads back gives the original weights exactly.
    convert_checkpoint(tmp_path / "mha", tmp_path / "back", ConvertOptions(groups=2))
    torch.testing.assert_close(_logits(tmp_path / "back"), _logits(src), rtol=1e-5, atol=1e-5)


def test_gqa_chain_down_to_mqa(tmp_path):
    src = save_tiny_model(tmp_path / "src", "llama", heads=8, kv_heads=8, hidden=64)
    convert_checkpoint(src, tmp_path / "g4", ConvertOptions(groups=4))
    convert_checkpoint(tmp_path / "g4", tmp_path / "g2", ConvertOptions(groups=2))
    convert_checkpoint(tmp_path / "g2", tmp_path / "g1", ConvertOptions(groups=1))
    convert_checkpoint(src, tmp_path / "direct", ConvertOptions(groups=1))
    # Mean of means over equal-sized groups is the mean: the chain equals the direct conversion.
    torch.testing.assert_close(_logits(tmp_path / "g1"), _logits(tmp_path / "direct"), rtol=1e-5, atol=1e-5)


def test_sharded_input_gives_sharded_output_with_valid_index(tmp_path):
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4, layers=4, max_shard_size="60KB")
    in_index = json.loads((src / "model.safetensors.index.json").read_text())
    in_files = sorted(set(in_index["weight_map"].values()))
    assert len(in_files) > 2
    convert_checkpoint(src, tmp_path / "out", ConvertOptions(groups=2))
    out_index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(out_index["weight_map"].values())) == in_files  # shards mirror the input
    assert set(out_index["weight_map"]) == set(in_index["weight_map"])
    total = 0
    for f in in_files:
        sf = SafetensorsFile(tmp_path / "out" / f)
        assert {n for n, s in out_index["weight_map"].items() if s == f} == set(sf.tensors)
        total += sum(t.nbytes for t in sf.tensors.values())
    assert out_index["metadata"]["total_size"] == total
    assert _load(tmp_path / "out").config.num_key_value_heads == 2


# zip_format False: the pre-zip format torch.save wrote before torch 1.6, which transformers still loads
# (and torch cannot memory-map).
@pytest.mark.parametrize("zip_format", [True, False])
def test_legacy_bin_input(tmp_path, zip_format):
    model_dir = save_tiny_model(tmp_path / "st", "llama", heads=4, kv_heads=4)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sd = _load(model_dir).state_dict()
    torch.save(
        {k: v.contiguous() for k, v in sd.items()},
        bin_dir / "pytorch_model.bin",
        _use_new_zipfile_serialization=zip_format,
    )
    for f in model_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            (bin_dir / f.name).write_bytes(f.read_bytes())
    convert_checkpoint(bin_dir, tmp_path / "out", ConvertOptions(groups=4))
    assert (tmp_path / "out" / "model.safetensors").is_file()
    torch.testing.assert_close(_logits(tmp_path / "out"), _logits(model_dir), rtol=0, atol=0)


def test_bf16_stays_bf16_and_dtype_option_casts(tmp_path):
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4, dtype=torch.bfloat16)
    convert_checkpoint(src, tmp_path / "keep", ConvertOptions(groups=2))
    assert {t.dtype for t in SafetensorsFile(tmp_path / "keep" / "model.safetensors").tensors.values()} == {
        "BF16"
    }
    convert_checkpoint(src, tmp_path / "f32", ConvertOptions(groups=2, dtype="float32"))
    assert {t.dtype for t in SafetensorsFile(tmp_path / "f32" / "model.safetensors").tensors.values()} == {
        "F32"
    }
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["dtype"] == "float32"
    torch.testing.assert_close(
        _logits(tmp_path / "f32").float(), _logits(tmp_path / "keep").float(), rtol=0.05, atol=0.05
    )


def test_output_has_tokenizer_provenance_and_card(tmp_path, tiny_llama):
    res = convert_checkpoint(tiny_llama, tmp_path / "out", ConvertOptions(groups=1, method="first"))
    out = tmp_path / "out"
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        "gqakit.json",
    ):
        assert (out / name).is_file(), name
    prov = json.loads((out / "gqakit.json").read_text())
    assert prov["groups"] == 1 and prov["method"] == "first" and prov["from_kv_heads"] == 4
    # provenance ties the output to its source's exact config, and records the time the CLI reports
    assert (
        prov["source_config_sha256"]
        == hashlib.sha256((Path(tiny_llama) / "config.json").read_bytes()).hexdigest()
    )
    assert prov["elapsed_s"] == res.elapsed_s and isinstance(prov["elapsed_s"], float)
    assert "MQA" in (out / "README.md").read_text()
    assert res.provenance == prov
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_random_method_is_reproducible(tmp_path, tiny_llama):
    convert_checkpoint(tiny_llama, tmp_path / "a", ConvertOptions(groups=2, method="random", seed=5))
    convert_checkpoint(tiny_llama, tmp_path / "b", ConvertOptions(groups=2, method="random", seed=5))
    convert_checkpoint(tiny_llama, tmp_path / "c", ConvertOptions(groups=2, method="random", seed=6))
    a, b, c = (SafetensorsFile(tmp_path / x / "model.safetensors") for x in "abc")
    name = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(a.read(name), b.read(name))
    assert not torch.equal(a.read(name), c.read(name))


def test_inspect_reports_geometry_and_kv_bytes(tiny_llama):
    info = inspect_checkpoint(tiny_llama)
    assert (info.num_heads, info.num_kv_heads, info.head_dim, info.num_layers) == (4, 4, 16, 2)
    # 2 (K and V) * 2 layers * G heads * 16 channels * 2 bytes (bf16)
    assert info.kv_bytes_per_token == {1: 128, 2: 256, 4: 512}
    assert info.parameters == sum(p.numel() for p in _load(tiny_llama).parameters())
    assert "K/V heads         4  (MHA)" in info.to_text()


def test_kv_bytes_per_gpu_under_tensor_parallelism_stop_shrinking_once_heads_replicate():
    from gqakit.geometry import AttentionGeometry, TensorParallelKV

    # H=8, G=2, head_dim 64, 2 layers, float16: 2 (K and V) * 2 layers * heads per GPU * 64 * 2 bytes
    geom = AttentionGeometry("llama", num_layers=2, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64)
    assert geom.tensor_parallel_kv() == [
        TensorParallelKV(1, 2, 1024, replicated=False),
        TensorParallelKV(2, 1, 512, replicated=False),
        # G=2 < TP: each GPU holds one whole K/V head (vLLM replicates it), transformers' TP refuses
        TensorParallelKV(4, 1, 512, replicated=True, transformers_refuses="TP 4 > 2 K/V heads"),
        TensorParallelKV(8, 1, 512, replicated=True, transformers_refuses="TP 8 > 2 K/V heads"),
    ]
    # a head count TP does not divide: H=12, G=6 at TP 4
    odd = AttentionGeometry("llama", num_layers=2, hidden_size=768, num_heads=12, num_kv_heads=6, head_dim=64)
    assert odd.tensor_parallel_kv()[2].transformers_refuses == "TP 4 does not divide 6 K/V heads"  # TP 4


def test_inspect_shows_the_tensor_parallel_table_in_text_and_json(tmp_path):
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=2)
    info = inspect_checkpoint(src)
    # bf16: 2 * 2 layers * heads per GPU * 16 channels * 2 bytes; from TP 4 on, one head per GPU
    assert [(t.tp, t.kv_bytes_per_gpu, t.replicated) for t in info.tensor_parallel] == [
        (1, 256, False), (2, 128, False), (4, 128, True), (8, 128, True)
    ]  # fmt: skip
    text = info.to_text()
    assert "KV cache per GPU per token, bf16, under tensor parallelism" in text
    assert "TP=2     1 K/V head(s)/GPU        128 bytes\n" in text
    assert "TP=8     1 K/V head(s)/GPU        128 bytes   K/V heads replicated (G=2 < TP); " in text
    assert "transformers' TP refuses: TP 8 > 2 K/V heads" in text
    tp = json.loads(info.to_json())["tensor_parallel"]
    assert tp[3] == {"tp": 8, "kv_heads_per_gpu": 1, "kv_bytes_per_gpu": 128, "replicated": True,
                     "transformers_refuses": "TP 8 > 2 K/V heads"}  # fmt: skip


def test_per_head_key_norms_are_regrouped(tmp_path):
    """stablelm with qk_layernorm keeps one LayerNorm per K/V head: they are pooled and renumbered."""
    src = save_tiny_model(tmp_path / "src", "stablelm", heads=4, kv_heads=4, qk_layernorm=True)
    convert_checkpoint(src, tmp_path / "g2", ConvertOptions(groups=2))
    names = set(SafetensorsFile(tmp_path / "g2" / "model.safetensors").tensors)
    assert "model.layers.0.self_attn.k_layernorm.norms.1.weight" in names
    assert "model.layers.0.self_attn.k_layernorm.norms.2.weight" not in names
    src_f = SafetensorsFile(src / "model.safetensors")
    norms = [src_f.read(f"model.layers.0.self_attn.k_layernorm.norms.{h}.weight") for h in (2, 3)]
    out = SafetensorsFile(tmp_path / "g2" / "model.safetensors")
    pooled = out.read("model.layers.0.self_attn.k_layernorm.norms.1.weight")
    torch.testing.assert_close(pooled, (norms[0] + norms[1]) / 2)
    assert _load(tmp_path / "g2").config.num_key_value_heads == 2
    # expansion copies each head's norm to every head of its group: exact
    expand_checkpoint(tmp_path / "g2", tmp_path / "mha")
    torch.testing.assert_close(_logits(tmp_path / "mha"), _logits(tmp_path / "g2"), rtol=1e-5, atol=1e-5)


def test_progress_false_prints_no_bars(tmp_path, tiny_llama, capfd):
    """Pipelines that print their own steps turn the converter's bars off (they filled their logs)."""
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    layerwise = ConvertOptions(groups=1, method="calibrated", calib_data=str(calib), calib_tokens=512)
    convert_checkpoint(tiny_llama, tmp_path / "shown", ConvertOptions(groups=1))
    assert "convert -> G=1" in capfd.readouterr().err  # the bar a user at a terminal sees
    convert_checkpoint(tiny_llama, tmp_path / "mean", ConvertOptions(groups=1), progress=False)
    convert_checkpoint(tiny_llama, tmp_path / "calibrated", layerwise, progress=False)
    expand_checkpoint(tmp_path / "mean", tmp_path / "expanded", progress=False)
    assert " -> G=" not in capfd.readouterr().err and (tmp_path / "expanded" / "config.json").exists()
    convert_checkpoint(tiny_llama, tmp_path / "layers", layerwise)
    assert "layer/s" in capfd.readouterr().err  # the layer-by-layer path's bar, in layers


def test_the_cli_no_progress_flag_turns_the_bars_off(tmp_path, tiny_llama, capfd):
    """``gqakit convert`` and ``gqakit expand`` take ``--no-progress`` as the pipelines do (logs of long
    conversions fill with bars otherwise)."""
    from gqakit.cli import main

    for args in (
        ["convert", str(tiny_llama), str(tmp_path / "g1"), "--groups", "1", "--no-progress"],
        ["expand", str(tmp_path / "g1"), str(tmp_path / "mha"), "--no-progress"],
    ):
        with pytest.raises(SystemExit) as done:
            main(args)
        assert done.value.code == 0
    err = capfd.readouterr().err
    assert " -> G=" not in err and "it/s" not in err
    assert (tmp_path / "mha" / "config.json").exists()
    with pytest.raises(SystemExit):
        main(["convert", str(tiny_llama), str(tmp_path / "shown"), "--groups", "1"])
    assert "convert -> G=1" in capfd.readouterr().err
