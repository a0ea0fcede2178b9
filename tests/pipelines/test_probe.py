"""``gqakit probe``: the table, JSON and plot, and its bad-input messages."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from tiny_models import TINY_TEXT, save_tiny_model

from gqakit.cli import main
from gqakit.errors import GqakitError
from gqakit.pipelines.probe import ProbeOptions, probe_checkpoint
from gqakit.pipelines.probe.report import probe_figure
from gqakit.problems import check_options


@pytest.fixture
def texts(tmp_path):
    calib, held_out = tmp_path / "calib.txt", tmp_path / "held_out.txt"
    calib.write_text(TINY_TEXT * 8)
    held_out.write_text(TINY_TEXT[::-1] * 2 + TINY_TEXT * 2)
    return calib, held_out


def test_probe_writes_table_json_and_plot(tmp_path, texts):
    calib, held_out = texts
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4)
    out = tmp_path / "probe"
    opts = ProbeOptions(
        groups=(1, 2), eval_data=str(held_out), methods=("mean", "first", "calibrated"),
        calib_data=str(calib), calib_tokens=256, eval_tokens=200, error_tokens=128, seq_len=64,
    )  # fmt: skip
    result = probe_checkpoint(src, out, opts)
    assert "| G | method | perplexity" in result.to_table()
    data = json.loads((out / "probe.json").read_text())
    rows = data["rows"]
    assert rows[0]["method"] == "original" and rows[0]["ppl_ratio"] == 1.0
    # 2 G x 3 methods, after the original
    assert len(rows) == 1 + 2 * 3
    for r in rows[1:]:
        # every converted layer's attention differs from the original's (G < 4 K/V heads of random weights)
        assert len(r["attn_error"]) == 2 and all(e > 0 for e in r["attn_error"]), r
        assert r["ppl"] > 0
        # the K/V reconstruction errors come with the conversions that fit merges on calibration text
        assert (r["key_error"] is not None) == (r["method"] == "calibrated"), r
    # fewer K/V heads lose more: each method's mean attention error grows from G = 2 to G = 1
    by = {(r["groups"], r["method"]): r["mean_attn_error"] for r in rows[1:]}
    assert all(by[(1, m)] > by[(2, m)] for (_, m) in by), by
    cal = [r for r in rows if r["method"] == "calibrated"]  # the calibrated merge beats mean pooling
    mean = [r for r in rows if r["method"] == "mean"]
    assert all(c["mean_attn_error"] < m["mean_attn_error"] for c, m in zip(cal, mean, strict=True))
    assert (out / "probe.md").read_text().count("\n|") >= 14
    # the KV cache per GPU under tensor parallelism, at the original's G and each G probed
    tp = data["tensor_parallel"]
    assert list(tp) == ["4", "2", "1"] and [t["tp"] for t in tp["1"]] == [1, 2, 4, 8]
    # G = 2 (K and V, 2 layers, 16 dims, bf16): 2 heads per GPU at TP 1, one from TP 2 on, replicated at 4
    per_head = 2 * 2 * 16 * 2
    assert [(t["kv_bytes_per_gpu"], t["replicated"]) for t in tp["2"]] == [
        (2 * per_head, False),
        (per_head, False),
        (per_head, True),
        (per_head, True),
    ]
    md = (out / "probe.md").read_text()
    assert "| K/V heads G | TP=1 | TP=2 | TP=4 | TP=8 |" in md
    assert "| 4 (original) | 512 | 256 | 128 | 128 (replicated, transformers refuses) |" in md
    png = (out / "probe.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    fig = probe_figure(result)  # the figure probe.png is: its axes as a reader sees them
    ppl_ax, err_ax = fig.axes
    assert err_ax.get_yscale() == "log" and len(err_ax.get_legend().get_texts()) == len(rows) - 1
    ppl = [r["ppl"] for r in rows]
    assert ppl_ax.get_yscale() == ("log" if max(ppl) / min(ppl) >= 10 else "linear")


def test_probe_without_calibration_runs_mean_only(tmp_path, texts):
    _, held_out = texts
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=2)
    result = probe_checkpoint(
        src,
        None,
        ProbeOptions(
            groups=(1,),
            eval_data=str(held_out),
            methods=("mean",),
            eval_tokens=128,
            error_tokens=64,
            seq_len=32,
        ),
    )
    assert [r.method for r in result.rows] == ["original", "mean"]
    assert result.rows[1].key_error is None and len(result.rows[1].attn_error) == 2


def test_probe_bad_input_reports_every_problem(tmp_path):
    opts = ProbeOptions(
        groups=(), eval_data=str(tmp_path / "missing.txt"), methods=("median", "calibrated"), seq_len=0
    )
    with pytest.raises(GqakitError) as e:
        check_options(opts, "probe")
    msg = str(e.value.message)
    for fragment in (
        "--groups needs",
        "--methods median",
        "need --calib-data",
        "--eval-data",
        "seq_len must",
    ):
        assert fragment in msg, msg


def test_probe_rejects_a_group_count_that_does_not_divide(tmp_path, texts):
    calib, held_out = texts
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4)
    res = CliRunner().invoke(
        main,
        [
            "probe",
            str(src),
            "--eval-data",
            str(held_out),
            "--groups",
            "3",
            "--methods",
            "mean",
            "--out",
            str(tmp_path / "p"),
        ],
    )
    assert res.exit_code == 2 and "does not divide" in res.output
    res = CliRunner().invoke(main, ["probe", str(src), "--eval-data", str(held_out), "--groups", "one"])
    assert res.exit_code == 2 and "comma-separated list of int" in res.output


@pytest.mark.parametrize(
    ("family", "kw", "says"),
    [
        (
            "gpt_neox",
            dict(use_parallel_residual=True),
            "Rewrite it first (`gqakit convert SRC SRC-phi --groups 4",
        ),
        ("gpt2", dict(activation_function="gelu_new"), "gpt_bigcode holds only G = 1 or 4: compare"),
    ],
)
def test_retargeted_families_get_what_to_do_instead(tmp_path, family, kw, says):
    src = save_tiny_model(tmp_path / family, family, **kw)
    text = tmp_path / "t.txt"
    text.write_text("some words here. " * 200)
    with pytest.raises(GqakitError) as e:
        probe_checkpoint(
            src, tmp_path / "o", ProbeOptions(groups=(1,), eval_data=str(text), methods=("mean",))
        )
    assert says in e.value.message and f"{family} converts by an exact rewrite" in e.value.message
    assert not (tmp_path / "o").exists()
