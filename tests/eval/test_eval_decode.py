"""Decode grid: measured KV bytes against the formula for G = H, H/2, 1; the bound; OOM; grids."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from gqakit.errors import GqakitError
from gqakit.eval.decode import bench_decode, parse_grid
from gqakit.eval.kv_bytes import (
    bytes_moved_per_step,
    config_geometry,
    measured_kv_bytes,
    predicted_kv_bytes,
    weight_bytes_per_step,
)
from gqakit.models import load_causal_lm


@pytest.mark.parametrize("layout, kv_heads", [("mha", 4), ("gqa", 2), ("mqa", 1)])
@pytest.mark.parametrize("static_cache", [False, True])
def test_measured_kv_bytes_equal_the_formula(tiny_models, layout, kv_heads, static_cache):
    model = load_causal_lm(tiny_models[layout], dtype="float32", device="cpu")
    assert model.config.num_key_value_heads == kv_heads
    points = bench_decode(
        model,
        batch_sizes=[1, 3],
        contexts=[8, 24],
        new_tokens=4,
        warmup=0,
        static_cache=static_cache,
        progress=False,
    )
    assert [(p.batch, p.context) for p in points] == [(1, 8), (1, 24), (3, 8), (3, 24)]
    for p in points:
        tokens = p.context + p.new_tokens - 1
        # 2 (K, V) * layers * batch * G * tokens * head_dim * 4 bytes
        formula = 2 * 2 * p.batch * kv_heads * tokens * 16 * 4
        assert p.status == "ok"
        assert p.kv_tokens == tokens
        assert p.kv_bytes == p.kv_bytes_predicted == formula
        assert p.prefill_s > 0 and p.decode_ms > 0
        assert p.tokens_per_s == pytest.approx(p.batch * 1000 / p.decode_ms)


@pytest.mark.parametrize(
    ("model_type", "config"),
    [
        ("gemma2", {}),  # layer_types: sliding, global
        ("gemma3_text", {}),  # every layer sliding at this depth
        ("mistral", {}),  # no layer_types: every layer slides
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 0}),
    ],
)
@pytest.mark.parametrize("static_cache", [False, True])
def test_sliding_window_layers_hold_at_most_their_window(model_type, config, static_cache):
    model = tiny_model(model_type, kv_heads=2, head_dim=16, sliding_window=16, **config)
    grid = {"batch_sizes": [2], "contexts": [40], "new_tokens": 3, "warmup": 0}
    (p,) = bench_decode(model, **grid, static_cache=static_cache, progress=False)
    full = predicted_kv_bytes({**model.config.to_dict(), "sliding_window": None}, 2, p.kv_tokens, "float32")
    assert p.kv_bytes == p.kv_bytes_predicted < full  # the window, not the 42 tokens, on sliding layers
    assert p.bytes_per_step < weight_bytes_per_step(model) + full


def test_predicted_kv_bytes_accepts_dicts_and_dtype_names(tiny_models):
    cfg = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}
    assert predicted_kv_bytes(cfg, 8, 2048, "bfloat16") == 2 * 30 * 8 * 3 * 2048 * 64 * 2
    assert predicted_kv_bytes(cfg, 1, 1, torch.float32) == 2 * 30 * 3 * 64 * 4


def _tiny_falcon(new_decoder_architecture: bool, multi_query: bool, num_kv_heads: int | None):
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    config = FalconConfig(
        vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=num_kv_heads,
        new_decoder_architecture=new_decoder_architecture, multi_query=multi_query,
    )  # fmt: skip
    return FalconForCausalLM(config).eval()


@pytest.mark.parametrize(
    "flags, weight_heads, cached_heads",
    [
        # Falcon-40B/180B's layout: G K/V heads, broadcast to all H query heads before they are cached,
        # whatever multi_query (on by default in FalconConfig) says
        ((True, True, 2), 2, 4),
        ((True, False, 2), 2, 4),
        ((False, True, None), 1, 1),  # Falcon-7B's: multi-query
        ((False, False, None), 4, 4),  # Falcon-RW's: a K/V head per query head
    ],
    ids=["new-mq", "new", "old-mq", "old"],
)
def test_falcon_kv_bytes_are_what_transformers_caches(flags, weight_heads, cached_heads):
    model = _tiny_falcon(*flags)
    # the weights: the fused projection holds H query heads and weight_heads keys and values of 8 channels
    assert model.transformer.h[0].self_attention.query_key_value.weight.shape[0] == (4 + 2 * weight_heads) * 8
    assert config_geometry(model.config).num_kv_heads == weight_heads
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 384, (2, 5)), use_cache=True).past_key_values
    assert cache.layers[0].keys.shape[1] == cached_heads
    real = measured_kv_bytes(cache)
    assert real == 2 * 2 * 2 * cached_heads * 5 * 8 * 4  # K and V, layers, batch, heads, tokens, dim, f32
    as_json = {k: v for k, v in model.config.to_dict().items() if not (k == "multi_query" and v)}
    for config in (model.config, as_json):  # a config.json may leave multi_query at FalconConfig's True
        assert predicted_kv_bytes(config, 2, 5, torch.float32) == real
    for prefill in ("model", "random"):  # generate()'s cache, and the random one gqakit fills itself
        grid = {"batch_sizes": [2], "contexts": [8], "new_tokens": 3, "warmup": 0}
        (p,) = bench_decode(model, **grid, prefill=prefill, progress=False)
        assert p.status == "ok" and p.kv_bytes == p.kv_bytes_predicted


def test_falcon_eval_result_reports_the_weights_heads_and_the_cached_bytes(tmp_path):
    from transformers import AutoConfig

    from gqakit.eval.hf_engine import measure_hf_model
    from gqakit.eval.options import EvalOptions

    _tiny_falcon(True, True, 2).save_pretrained(tmp_path)
    opts = EvalOptions(
        bench=True, batch_sizes=(2,), new_tokens=3, warmup=0, device="cpu", dtype="float32", progress=False
    )
    config = AutoConfig.from_pretrained(tmp_path)
    res = measure_hf_model("falcon", str(tmp_path), config=config, options=opts, texts=None, contexts=[8])
    (p,) = res.decode
    assert res.num_kv_heads == 2  # GQA-2 in its weights, and its cache holds all 4 query heads' copies
    assert res.kv_bytes_per_token == 2 * 2 * 4 * 8 * 4
    assert p.kv_bytes == res.kv_bytes_per_token * p.batch * p.kv_tokens
    # the report says which heads its bytes count: the weights' 2 and the cache's 4, with a note why
    assert res.cached_kv_heads == 4
    from gqakit.eval.report import render_markdown
    from gqakit.eval.results import EvalResults, environment

    env = environment(torch.device("cpu"), "gqakit eval falcon")
    report = render_markdown(EvalResults({"falcon": res}, None, opts, env), plots=[])
    assert "| falcon | 2/4 (cache: 4) |" in report
    assert "transformers repeats Falcon-40B/180B's K/V heads for each query head" in report


def test_bytes_moved_and_bound(tiny_models):
    mha = load_causal_lm(tiny_models["mha"], dtype="float32", device="cpu")
    mqa = load_causal_lm(tiny_models["mqa"], dtype="float32", device="cpu")
    # Untied embeddings: the input table is a lookup, not a full read.
    emb = mha.get_input_embeddings().weight
    params = sum(p.numel() * 4 for p in mha.parameters())
    assert weight_bytes_per_step(mha) == params - emb.numel() * 4
    assert bytes_moved_per_step(mha, 2, 100) == weight_bytes_per_step(mha) + 2 * 2 * 2 * 4 * 100 * 16 * 4
    base, cand = bytes_moved_per_step(mha, 8, 200), bytes_moved_per_step(mqa, 8, 200)
    assert base / cand > 1  # the speedup that moving fewer bytes per step allows


def test_oom_point_is_recorded_and_the_grid_goes_on(tiny_models, monkeypatch):
    model = load_causal_lm(tiny_models["gqa"], dtype="float32", device="cpu")
    real = model.generate

    def generate(*args, **kwargs):
        if kwargs["input_ids"].shape[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    points = bench_decode(model, batch_sizes=[1, 2, 3], contexts=[8], new_tokens=3, warmup=0, progress=False)
    assert [p.status for p in points] == ["ok", "oom", "ok"]
    assert points[1].tokens_per_s is None and "out of memory" in points[1].error
    assert points[1].kv_bytes_predicted > 0


def test_other_errors_are_not_swallowed(tiny_models, monkeypatch):
    model = load_causal_lm(tiny_models["gqa"], dtype="float32", device="cpu")
    monkeypatch.setattr(model, "generate", lambda *a, **k: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        bench_decode(model, batch_sizes=[1], contexts=[8], new_tokens=3, warmup=0, progress=False)


@pytest.mark.parametrize(
    "value, message",
    [
        ("1,x,3", "not a comma-separated list"),
        ("0,8", "non-positive"),
        ("", "not a comma-separated"),
        ("8,8", "repeats"),
    ],
)
def test_malformed_grids(value, message):
    with pytest.raises(GqakitError, match=message):
        parse_grid(value, "--batch-sizes")


def test_grid_parsing():
    assert parse_grid("1, 8,32", "--batch-sizes") == (1, 8, 32)
    assert parse_grid([256, 1024], "--contexts") == (256, 1024)


@pytest.mark.gpu
@pytest.mark.parametrize("static_cache", [False, True])
def test_decode_on_cuda_in_bfloat16(tiny_models, static_cache):
    model = load_causal_lm(tiny_models["gqa"], dtype="bfloat16", device="cuda")
    points = bench_decode(
        model,
        batch_sizes=[2],
        contexts=[16],
        new_tokens=4,
        warmup=1,
        static_cache=static_cache,
        progress=False,
    )
    p = points[0]
    assert p.status == "ok" and p.static_cache == static_cache
    assert p.kv_bytes == p.kv_bytes_predicted == 2 * 2 * 2 * 2 * (16 + 3) * 16 * 2
