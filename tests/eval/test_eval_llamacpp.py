"""``gqakit eval --engine llamacpp``: the engine table, its bad input, the GGUF cache, a .gguf as the
model, and (marked slow: it needs the built binding) llama.cpp's perplexity against transformers'."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from gqakit.cli import main
from gqakit.errors import GqakitError
from gqakit.eval import EvalOptions
from gqakit.testing import TINY_TEXT, save_tiny_model


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TINY_TEXT * 3)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GQAKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_engine_options_are_checked_with_the_others():
    with pytest.raises(GqakitError) as e:
        EvalOptions(ppl_data="x.txt", engine="sglang", gguf_type="q4", seq_len=0)
    for fragment in ("--engine 'sglang' is unknown", "--gguf-type 'q4' is unknown", "--seq-len"):
        assert fragment in e.value.message
    with pytest.raises(GqakitError, match="--tasks runs lm-eval on transformers: use --engine hf"):
        EvalOptions(tasks="gqakit_ppl", engine="llamacpp")


def test_a_missing_binding_names_the_install_command(tmp_path, text, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    res = CliRunner().invoke(main, ["eval", str(model), "--ppl-data", str(text), "--engine", "llamacpp"])
    assert res.exit_code != 0
    assert 'pip install -e ".[llamacpp]"' in res.output and "Traceback" not in res.output


def test_the_gguf_export_is_cached_by_the_checkpoints_files(tmp_path, cache, monkeypatch):
    import gqakit.eval.llamacpp_engine as engine
    from gqakit.eval.llamacpp_engine import gguf_for

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    first = gguf_for(str(model), "f32")
    stamp = first.stat().st_mtime_ns
    assert gguf_for(str(model), "f32") == first and first.stat().st_mtime_ns == stamp  # not re-exported
    assert gguf_for(str(model), "f16") != first  # another weight type, another file
    save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2, seed=1)  # the checkpoint changes
    assert gguf_for(str(model), "f32") != first
    assert all(p.parent == cache / "gguf" for p in (first,))
    # a gqakit whose export writes another file for the same checkpoint does not reuse an older one's
    latest = gguf_for(str(model), "f32")
    monkeypatch.setattr(engine, "EXPORT_VERSION", engine.EXPORT_VERSION + 1)
    assert gguf_for(str(model), "f32") != latest


def test_a_gguf_model_is_evaluated_like_its_checkpoint(tmp_path, text, cache):
    from gqakit.gguf import export_gguf

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    gguf = export_gguf(model, tmp_path / "m.gguf", out_type="f32").path
    args = ["--ppl-data", str(text), "--seq-len", "64"]
    a = CliRunner().invoke(main, ["eval", str(model), *args, "--out", str(tmp_path / "a")])
    b = CliRunner().invoke(main, ["eval", str(gguf), *args, "--out", str(tmp_path / "b")])
    assert a.exit_code == 0 and b.exit_code == 0, b.output
    ppl = [json.loads((tmp_path / d / "results.json").read_text()) for d in ("a", "b")]
    ppl = [next(iter(r["models"].values()))["perplexity"]["ppl"] for r in ppl]
    assert ppl[1] == pytest.approx(ppl[0], rel=1e-5)
    assert len(list((cache / "gguf-dequantized").iterdir())) == 1  # dequantized once, cached


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_llamacpp_perplexity_equals_transformers(tmp_path, text, cache, kv_heads):
    pytest.importorskip("llama_cpp")
    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=kv_heads)
    out = {}
    for engine in ("hf", "llamacpp"):
        args = [
            "eval",
            str(model),
            "--ppl-data",
            str(text),
            "--seq-len",
            "64",
            "--out",
            str(tmp_path / engine),
        ]
        res = CliRunner().invoke(main, [*args, "--engine", engine, "--gguf-type", "f32"])
        assert res.exit_code == 0, res.output
        out[engine] = next(
            iter(json.loads((tmp_path / engine / "results.json").read_text())["models"].values())
        )
    hf, lc = out["hf"]["perplexity"], out["llamacpp"]["perplexity"]
    assert lc["tokens"] == hf["tokens"]  # the same windows
    assert lc["ppl"] == pytest.approx(hf["ppl"], rel=1e-4)  # f32 weights and KV cache: the same function
