"""evaluate_models on three layouts, and the report it writes: report.md, results.json, PNG plots."""

from __future__ import annotations

import copy
import dataclasses
import json
import platform
from pathlib import Path

import pytest

from gqakit.errors import GqakitError
from gqakit.eval.api import EvalOptions, evaluate, evaluate_models
from gqakit.eval.report import write_report

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def three_way(tiny_models, tmp_path_factory):
    text = tmp_path_factory.mktemp("data") / "text.txt"
    text.write_text("The keeper climbed the stair and lit the lamp. " * 20)
    options = EvalOptions(
        ppl_data=str(text),
        seq_len=32,
        batch_size=4,
        bench=True,
        batch_sizes="1,2",
        contexts="8,16",
        new_tokens=3,
        warmup=0,
        tasks="gqakit_mc",
        lm_eval_args="--limit 4",
        device="cpu",
        progress=False,
        command_line="pytest",
    )
    models = {
        "MHA-4": str(tiny_models["mha"]),
        "GQA-2": str(tiny_models["gqa"]),
        "MQA": str(tiny_models["mqa"]),
    }
    return evaluate_models(models, options)


def test_results_hold_every_model_and_comparisons(three_way):
    assert list(three_way.models) == ["MHA-4", "GQA-2", "MQA"] and three_way.baseline == "MHA-4"
    assert [m.num_kv_heads for m in three_way.models.values()] == [4, 2, 1]
    for m in three_way.models.values():
        assert m.perplexity.tokens > 0 and len(m.decode) == 4
        assert "gqakit_mc/acc" in m.task_metrics()
    comps = three_way.comparisons()
    assert set(comps) == {"GQA-2", "MQA"}
    assert comps["MQA"]["kv_cache_ratio"] == 0.25
    d = comps["MQA"]["decode"][0]
    assert d["bound"] > 1 and d["speedup"] > 0 and d["kv_bytes_ratio"] == 0.25
    base = three_way.models["MHA-4"].perplexity
    assert comps["GQA-2"]["ppl_delta"] == pytest.approx(three_way.models["GQA-2"].perplexity.ppl - base.ppl)


def test_report_files_and_plots(three_way, tmp_path):
    report = write_report(three_way, tmp_path / "report")
    out = report.parent
    assert report.name == "report.md"
    for name in ("decode_tokens_per_s.png", "kv_cache_mib.png", "perplexity.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000
    md = report.read_text()
    assert "| **MHA-4** (baseline) | 4/4 |" in md
    assert "| MQA | 1/4 |" in md
    assert "bound (bytes moved)" in md and "## Decode grid" in md and "## lm-eval" in md
    res = json.loads((out / "results.json").read_text())
    assert res["environment"]["command_line"] == "pytest"
    assert {"torch", "transformers", "lm_eval", "gqakit"} <= set(res["environment"]["versions"])
    assert res["models"]["MQA"]["decode"][0]["kv_bytes"] > 0
    assert res["models"]["GQA-2"]["perplexity"]["bits_per_byte"] > 0
    assert res["options"]["batch_sizes"] == [1, 2]
    assert set(res["comparisons"]) == {"GQA-2", "MQA"}
    assert sorted(res["plots"]) == ["decode_tokens_per_s.png", "kv_cache_mib.png", "perplexity.png"]


def test_a_metric_under_several_filters_keeps_each_and_an_unread_kv_cache_is_a_dash(three_way, tmp_path):
    res = copy.deepcopy(three_way)
    mqa = res.models["MQA"]
    mqa.lm_eval = {
        "results": {
            "gsm8k": {  # lm-eval scores gsm8k's exact_match under two filters
                "alias": "gsm8k",
                "exact_match,strict-match": 1.0,
                "exact_match_stderr,strict-match": 0.1,
                "exact_match,flexible-extract": 0.0,
            },
            "arc_easy": {"acc,none": 0.5},
        }
    }
    assert mqa.task_metrics() == {
        "gsm8k/exact_match (strict-match)": 1.0,
        "gsm8k/exact_match (flexible-extract)": 0.0,
        "arc_easy/acc": 0.5,
    }
    # an engine that reported no KV bytes for a point (a llama.cpp log gqakit cannot read)
    mqa.decode[0] = dataclasses.replace(mqa.decode[0], kv_bytes=None)
    assert res.comparisons()["MQA"]["decode"][0]["kv_bytes_ratio"] is None
    md = write_report(res, tmp_path / "report").read_text()
    p = mqa.decode[0]
    row = next(ln for ln in md.splitlines() if ln.startswith(f"| MQA | {p.batch} | {p.context} |"))
    assert row.split(" | ")[6] == "–"  # KV MiB (measured)
    assert "gsm8k/exact_match (flexible-extract)" in md


def test_single_model_without_bench_still_reports(tiny_models, tmp_path, known_txt):
    res = evaluate(
        str(tiny_models["gqa"]),
        None,
        EvalOptions(ppl_data=str(known_txt), seq_len=16, device="cpu", progress=False),
    )
    assert res.baseline is None and res.comparisons() == {}
    report = write_report(res, tmp_path)
    assert (tmp_path / "perplexity.png").read_bytes().startswith(PNG)
    assert {p.name for p in tmp_path.glob("*.png")} == {"perplexity.png"}  # no decode, no KV plot
    assert "| gqa | 2/4 |" in report.read_text()


def test_options_report_every_problem_at_once():
    with pytest.raises(GqakitError) as err:
        EvalOptions(seq_len=0, batch_sizes="1,x", contexts="0", dtype="fp8", lm_eval_args="--bogus 1")
    msg = err.value.message
    for part in (
        "--batch-sizes",
        "--contexts",
        "--seq-len must be at least 1",
        "--dtype 'fp8'",
        "'bogus'",
        "Nothing to evaluate",
    ):
        assert part in msg


def test_default_contexts_are_clipped_to_the_models_positions(tiny_models):
    res = evaluate(
        str(tiny_models["mqa"]),
        None,
        EvalOptions(bench=True, batch_sizes="1", new_tokens=3, warmup=0, device="cpu", progress=False),
    )
    # 256 positions: none of 256, 1024, 4096 leaves room for 3 new tokens, so the longest that does.
    assert [p.context for p in res.models["mqa"].decode] == [253]


def test_results_name_the_cpu_by_its_model():
    """``platform.processor()`` is empty on Linux, so results.json read ``x86_64``; /proc/cpuinfo names it."""
    import torch

    from gqakit.eval.results import environment
    from gqakit.models import cpu_model

    name = environment(torch.device("cpu"), "gqakit eval m")["device_name"]
    assert name.startswith(f"{cpu_model()}, ") and "CPUs" in name
    if Path("/proc/cpuinfo").is_file() and "model name" in Path("/proc/cpuinfo").read_text():
        assert not name.startswith(f"{platform.machine()},")
