"""The report and plots from results made by hand: log axes where values span orders of magnitude, a
figure that is not finite reported instead of crashing the plots."""

from __future__ import annotations

import math

import pytest

from gqakit.eval import plots
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import PerplexityResult
from gqakit.eval.report import write_report
from gqakit.eval.results import EvalResults, ModelResult

ENV = {
    "command_line": "pytest",
    "device": "cpu",
    "device_name": "test CPU",
    "versions": {"gqakit": "0", "torch": "0", "transformers": "0", "lm_eval": "0"},
}


def _model(label: str, ppl: float, kv_heads: int) -> ModelResult:
    nll = math.log(ppl) if math.isfinite(ppl) else ppl
    return ModelResult(
        label=label, path=label, model_type="llama", num_layers=2, num_heads=4, num_kv_heads=kv_heads,
        head_dim=8, parameters=1000, dtype="float32", kv_bytes_per_token=2 * 2 * kv_heads * 8 * 4,
        weight_bytes=4000, load_s=0.0,
        perplexity=PerplexityResult(ppl, nll, nll / 3, tokens=100, bytes=300, seq_len=32, stride=32),
    )  # fmt: skip


def _results(*models: ModelResult) -> EvalResults:
    options = EvalOptions(ppl_data="wiki.txt", device="cpu", progress=False)
    return EvalResults({m.label: m for m in models}, models[0].label, options, ENV)


@pytest.fixture
def scales(monkeypatch):
    """The y scales of each plot written, by file name."""
    seen: dict[str, list[str]] = {}
    save = plots._save

    def recording(fig, path, ax=None):
        seen[path.name] = [a.get_yscale() for a in fig.axes]
        return save(fig, path, ax)

    monkeypatch.setattr(plots, "_save", recording)
    return seen


def test_an_axis_is_logarithmic_where_values_span_orders_of_magnitude():
    def log(values) -> bool:
        _, ax = plots.figure(figsize=(2, 2))
        return plots.log_axis(ax, values, "perplexity") and ax.get_yscale() == "log"

    assert log([12.9, 17_395.0])
    assert not log([12.9, 14.2, 13.1])
    assert not log([12.9, float("nan")])  # one finite value: nothing to span
    assert log([12.9, float("inf"), 17_395.0, None])


def test_perplexity_spanning_orders_of_magnitude_is_plotted_on_a_log_axis(tmp_path, scales):
    res = _results(_model("MHA", 12.9, 4), _model("MQA, mean", 17_395.0, 1))
    write_report(res, tmp_path)
    assert scales["perplexity.png"][0] == "log"
    close = _results(_model("MHA", 12.9, 4), _model("GQA-2", 13.4, 2))
    write_report(close, tmp_path / "close")
    assert scales["perplexity.png"] == ["linear", "linear"]


def test_a_nan_perplexity_is_reported_not_plotted(tmp_path, scales):
    res = _results(_model("MHA", 12.9, 4), _model("MQA", float("nan"), 1), _model("GQA-2", float("inf"), 2))
    report = write_report(res, tmp_path).read_text()
    assert (tmp_path / "perplexity.png").is_file() and "perplexity.png" in scales
    assert "Not finite: MQA's perplexity (nan); the plots leave it out." in report
    assert "Not finite: GQA-2's perplexity (inf)" in report
    assert "| MQA | 1/4 |" in report and "nan" in report


def test_no_finite_perplexity_writes_no_perplexity_plot(tmp_path):
    res = _results(_model("MHA", float("nan"), 4))
    write_report(res, tmp_path)
    assert not list(tmp_path.glob("*.png"))  # without --bench, nothing else to plot
