"""Every pipeline plot, rendered from made-up figures and checked for what a reader sees at a glance: the
report table's names, labels that do not overlap, log axes where values span orders of magnitude, and
titles that claim only what was measured."""

from __future__ import annotations

import json
from itertools import combinations
from types import SimpleNamespace as NS

import pytest

from gqakit.eval.decode import round_stats
from gqakit.pipelines.demo import ModelEval
from gqakit.pipelines.demo.report import demo_figures
from gqakit.pipelines.recovery.curves import Curve
from gqakit.pipelines.recovery.report import recovery_figure

# the demo's rows as the README's table names them, mean pooling about 25x off after uptraining
DEMO = [
    ("MHA-9 (expanded)", 9, 15.93), ("GQA-3 (mean)", 3, 15.93), ("MQA (mean), before uptraining", 1, 17395.0),
    ("MQA (fast), before uptraining", 1, 230.0), ("MQA (mean), after uptraining", 1, 400.0),
    ("MQA (fast), after uptraining", 1, 40.0),
]  # fmt: skip


def _row(label: str, g: int, ppl: float) -> ModelEval:
    point = NS(batch=8, context=512, tokens_per_s=100.0 / g)
    result = NS(num_kv_heads=g, perplexity=NS(ppl=ppl, bits_per_byte=ppl**0.1, tokens=8192),
                kv_bytes_per_token=2 * 30 * 64 * g * 4, decode=[point])  # fmt: skip
    row = ModelEval(label, result, 1.0)  # type: ignore[arg-type]
    row.decode_stats = round_stats([100.0 / g] * 5)
    return row


def _no_overlap(fig, labels) -> None:
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in labels if t.get_text()]
    assert boxes, "no labels drawn"
    for a, b in combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)


@pytest.fixture
def demo(tmp_path):
    uptrained = {}
    for slug, label, start, end in (
        ("mqa-mean", "MQA (mean)", 17395.0, 400.0),
        ("mqa-fast", "MQA (fast)", 230.0, 40.0),
    ):
        metrics = tmp_path / f"{slug}.jsonl"
        points = [
            {"tokens": t, "val_ppl": start * (end / start) ** (i / 3)}
            for i, t in enumerate((0, 10, 100, 1000))
        ]
        metrics.write_text("".join(json.dumps(p) + "\n" for p in points))
        uptrained[slug] = {"label": label, "metrics": str(metrics)}
    return demo_figures([_row(*r) for r in DEMO], uptrained, "float32")


def test_the_demos_quality_labels_are_the_tables_and_never_overlap(demo):
    ppl_ax, bpb_ax = demo["quality.png"].axes
    labels = ppl_ax.get_yticklabels()
    top_down = sorted(labels, key=lambda t: -t.get_position()[1])
    assert [t.get_text() for t in top_down] == [r[0] for r in DEMO]  # the table's rows, first on top
    _no_overlap(demo["quality.png"], labels)
    assert ppl_ax.get_xscale() == "log" and "log scale" in ppl_ax.get_xlabel()  # 15.9 beside 17,395
    assert bpb_ax.get_xscale() == "linear"  # 1.3 to 2.7: no order of magnitude


def test_the_demos_uptraining_plot_names_the_rows_and_claims_only_what_it_measured(demo):
    ax = demo["uptraining.png"].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["MQA (mean)", "MQA (fast)"]
    assert ax.get_yscale() == "log"
    title = ax.get_title().lower()
    assert "recover" not in title and "validation perplexity" in title


def test_the_demos_decode_labels_never_overlap(demo):
    kv_ax, decode_ax = demo["kv_decode.png"].axes
    _no_overlap(demo["kv_decode.png"], decode_ax.get_yticklabels())
    assert kv_ax.get_yscale() == "log"  # 9 K/V heads beside 1
    assert "buy" not in demo["kv_decode.png"]._suptitle.get_text()


def test_the_recovery_plot_names_each_curve_as_the_tables_do():
    curves = [Curve("mean", [(0, 400.0), (128, 60.0), (1024, 20.0)], 1, 1),
              Curve("fast", [(0, 30.0), (128, 18.0), (1024, 16.5)], 1, 1)]  # fmt: skip
    near, whole = recovery_figure(16.0, curves, "x -> 1 K/V heads").axes
    texts = [t.get_text() for t in near.get_legend().get_texts()]
    assert texts[:2] == ["mean", "fast"]
    assert near.get_yscale() == whole.get_yscale() == "log"
