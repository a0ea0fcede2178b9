"""The demo's whole pipeline on a tiny random GQA model: the same code path as ``gqakit demo``, with
the asset step replaced by a model and text files made here, and a budget of a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import TINY_TEXT, save_tiny_model

from gqakit.cli import main
from gqakit.errors import GqakitError
from gqakit.pipelines.demo import DemoAssets, DemoOptions, render_table, run_demo
from gqakit.pipelines.demo.options import Variant
from gqakit.storage import working_directory

# The shipped recipe, shrunk to the tiny model: a few optimizer steps on 32-token blocks.
TINY_RECIPE = (
    "data.seq_len=32",
    "train.batch_size=2",
    "budget.steps=3",
    "budget.tokens=null",
    "budget.alpha=null",
    "eval.every=0",
    "checkpoint.every=0",
    "data.max_val_blocks=4",
)


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory) -> DemoAssets:
    root = tmp_path_factory.mktemp("assets")
    model = save_tiny_model(root / "model", "llama", heads=4, kv_heads=2, layers=2, hidden=64)
    sentences = [s.strip() + "." for s in TINY_TEXT.split(".") if s.strip()]
    files = {}
    for split, reps in (("train", 6), ("validation", 1), ("test", 2)):
        files[split] = root / f"{split}.txt"
        files[split].write_text("".join(line + "\n" for line in sentences * reps))
    return DemoAssets(model, files["train"], files["validation"], files["test"])


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    """One working directory for the module: a later test reuses what an earlier one computed."""
    return tmp_path_factory.mktemp("work")


def tiny_options(tmp_path: Path, assets: DemoAssets, messages: list[str], **kw) -> DemoOptions:
    settings = dict(
        work_dir=tmp_path / "work",
        out=tmp_path / "report",
        device="cpu",
        seq_len=64,
        eval_tokens=256,
        decode_context=16,
        sets=(*TINY_RECIPE, "model.convert.calib_tokens=512"),
        assets=lambda options: assets,
        progress=False,
        echo=messages.append,
    )
    return DemoOptions(**{**settings, **kw})


def test_demo_pipeline_end_to_end_on_a_tiny_model(tmp_path, tiny_assets, work_dir, capfd):
    messages: list[str] = []
    res = run_demo(tiny_options(tmp_path, tiny_assets, messages, work_dir=work_dir))
    # one line per step and its results: no bars (progress=False), no library chatter (matplotlib's font
    # cache, transformers), no log line repeating a step
    assert capfd.readouterr().err == ""
    assert [m.split("]")[0] for m in messages if m.startswith("[")] == [f"[{k}/7" for k in range(1, 8)]
    assert all(m.startswith(("gqakit demo:", "[", "      ", "\n|", "Report:")) for m in messages), messages

    labels = [r.label for r in res.rows]
    assert labels == [
        "MHA-4 (expanded)",
        "GQA-2 (mean)",
        "MQA (mean), before uptraining",
        "MQA (fast), before uptraining",
        "MQA (mean), after uptraining",
        "MQA (fast), after uptraining",
    ]
    # Expanding and pooling back are exact: same logits, so the same perplexity as the original.
    assert res.checks == {"MHA-4 vs original": 0.0, "GQA-2 (mean) vs original": 0.0}
    assert res.rows[0].ppl == pytest.approx(res.original.ppl, rel=1e-6)
    assert res.rows[1].ppl == pytest.approx(res.original.ppl, rel=1e-6)
    # KV cache: 2 (K, V) * 2 layers * G heads * 16 dims * 4 bytes * 2048 tokens.
    assert [r.kv_mib for r in res.rows] == pytest.approx(
        [2 * 2 * g * 16 * 4 * 2048 / 2**20 for g in (4, 2, 1, 1, 1, 1)]
    )
    assert all(r.decode_tokens_per_s and r.decode_tokens_per_s > 0 for r in res.rows)
    assert res.uptrain["mqa-mean"]["steps"] == 3
    assert res.uptrain["mqa-fast"]["recipe"] == "smollm2-135m-mqa-refined"  # its own recipe
    prov = json.loads((work_dir / "models" / "mqa-fast" / "gqakit.json").read_text())
    assert prov["method"] == "calibrated" and prov["refine"]["steps"] == 200

    text = res.report.read_text()
    assert render_table(res.rows, 8, 16, "float32") in text
    assert "| MQA (mean), after uptraining | 1 |" in text
    for plot in res.plots:
        assert plot.is_file() and plot.stat().st_size > 1000
    assert {p.name for p in res.plots} >= {"quality.png", "kv_decode.png"}
    results = json.loads(res.results_json.read_text())
    assert [r["label"] for r in results["rows"]] == labels
    assert any(m.startswith("[7/7]") for m in messages) and f"Report: {res.report}" in messages
    # Decode is measured side by side: every model (the original too) once per round, median shown.
    decode_notes = [m for m in messages if "(rounds: " in m]
    assert len(decode_notes) == len(res.rows) + 1
    assert all(m.split("(rounds: ")[1].count(" / ") == 4 for m in decode_notes)  # 5 rounds by default
    for note in decode_notes:  # the table's figure is the model's median round
        shown = float(note.split(": ")[1].split(" tok/s")[0].replace(",", ""))
        rounds = [float(r.replace(",", "")) for r in note.split("(rounds: ")[1].rstrip(")").split(" / ")]
        assert shown == pytest.approx(sorted(rounds)[2], abs=0.051)

    # A second run reuses every checkpoint and measurement.
    again: list[str] = []
    res2 = run_demo(tiny_options(tmp_path, tiny_assets, again, work_dir=work_dir))
    assert [r.ppl for r in res2.rows] == [r.ppl for r in res.rows]
    assert [r.decode_tokens_per_s for r in res2.rows] == [r.decode_tokens_per_s for r in res.rows]
    assert sum(": cached (" in m for m in again) == 7 and sum("reusing" in m for m in again) == 2
    # the re-run's report keeps the time the figures took beside its own seconds
    assert "the runs that computed these figures took" in res2.report.read_text()
    assert res2.settings["compute_s"] == pytest.approx(res.settings["compute_s"])
    # every result stored with its time: no unfinished computation's time left behind
    assert not list((work_dir / "results").glob(".*"))


def test_without_the_llamacpp_binding_the_demo_says_how_to_install_it(
    tmp_path, tiny_assets, work_dir, monkeypatch
):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    messages: list[str] = []
    res = run_demo(tiny_options(tmp_path, tiny_assets, messages, work_dir=work_dir))
    assert any("llama.cpp column skipped" in m and 'pip install -e ".[llamacpp]"' in m for m in messages)
    assert "llama.cpp tokens/s" not in res.report.read_text()


def test_with_the_llamacpp_binding_the_demo_adds_its_decode_column(tmp_path, tiny_assets, work_dir):
    pytest.importorskip("llama_cpp")
    res = run_demo(tiny_options(tmp_path, tiny_assets, [], work_dir=work_dir))
    assert all(r.llamacpp_stats is not None and r.llamacpp_stats.median for r in res.rows)
    table = render_table(res.rows, 8, 16, "float32")
    assert "llama.cpp tokens/s (f16, batch 1, context 16)" in table and table in res.report.read_text()


def test_bad_options_are_reported_together(tmp_path, tiny_assets):
    opts = tiny_options(tmp_path, tiny_assets, [], budget_scale=0, seq_len=0, decode_rounds=0)
    with pytest.raises(GqakitError) as err:
        run_demo(opts)
    # seq_len is not a flag of gqakit demo: the message names the field, not a --seq-len it lacks
    assert all(f in str(err.value) for f in ("--budget-scale", "seq_len must", "--decode-rounds"))
    assert "--seq-len" not in str(err.value)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"sets": ("train.nosuch=1",)}, "train.nosuch: unknown key"),
        ({"sets": ("train.lr",)}, "override 'train.lr' is not key=value"),
    ],
)
def test_a_bad_recipe_or_override_is_reported_before_any_step(tmp_path, tiny_assets, kw, message):
    messages: list[str] = []
    with pytest.raises(GqakitError, match=message):
        run_demo(tiny_options(tmp_path, tiny_assets, messages, **kw))
    assert not any(m.startswith("[1/") for m in messages)


def test_a_working_directory_another_run_holds_is_refused_before_any_step(tmp_path, tiny_assets):
    messages: list[str] = []
    opts = tiny_options(tmp_path, tiny_assets, messages, work_dir=tmp_path / "held")
    with working_directory(tmp_path / "held"):
        with pytest.raises(GqakitError, match=r"--work-dir .*held is in use by another run \(pid"):
            run_demo(opts)
    assert messages == [] and not (tmp_path / "held" / "results").exists()


def test_decode_rounds_that_disagree_give_no_speedup():
    """Injected round timings: a steady model and one whose load changed mid-measurement."""
    from gqakit.eval.decode import DECODE_TOLERANCE, round_stats, speedup

    base = round_stats([40.0, 42.0, 41.0, 39.5, 40.5])
    steady = round_stats([80.0, 78.0, 81.0, 79.0, 80.5])
    loaded = round_stats([80.0, 78.0, 20.0, 79.0, 80.5])  # a background job during round 3
    assert base.reliable and steady.reliable and not loaded.reliable
    assert base.median == 40.5 and base.spread == pytest.approx(2.5 / 40.5)
    assert speedup(steady, base) == "1.98x"
    assert speedup(loaded, base) == "unreliable" and speedup(base, loaded) == "unreliable"
    assert "unreliable" in loaded.describe()
    assert not round_stats([None, None]).reliable and speedup(round_stats([None]), base) == "-"
    edge = round_stats([100.0, 100.0 * (1 + DECODE_TOLERANCE)])
    assert edge.reliable  # a spread of exactly the tolerance is still within it


def test_demo_help_names_the_options():
    res = CliRunner().invoke(main, ["demo", "--help"])
    assert res.exit_code == 0
    for flag in (
        "--work-dir",
        "--out",
        "--budget-scale",
        "--decode-rounds",
        "--device",
        "--set",
    ):
        assert flag in res.output


def test_progress_bars_change_neither_the_uptraining_cache_nor_what_resumes(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from gqakit.pipelines import steps as run_keys
    from gqakit.pipelines.demo import run
    from gqakit.pipelines.steps import Steps
    from gqakit.pipelines.store import ResultStore

    calls: list[bool] = []

    def fake_uptrain(recipe, resume, force):
        """Stands in for the training: records whether it resumed, writes what a finished run leaves."""
        calls.append(resume)
        out = Path(recipe.output_dir)
        out.mkdir(exist_ok=True)
        (out / "recipe.yaml").write_text(recipe.to_yaml())
        (out / "gqakit.json").write_text("{}")
        return SimpleNamespace(output_dir=out, steps=3, tokens=96, initial_val_ppl=9.0, final_val_ppl=8.0,
                               elapsed_s=1.0, history=[], alpha=None)  # fmt: skip

    monkeypatch.setattr(run_keys, "uptrain", fake_uptrain)
    student = tmp_path / "student"
    student.mkdir()
    (student / "config.json").write_text("{}")
    assets = DemoAssets(student, tmp_path / "train.txt", tmp_path / "val.txt", tmp_path / "test.txt")

    def uptrain(progress: bool, out: Path, store: ResultStore) -> None:
        o = DemoOptions(progress=progress, sets=TINY_RECIPE)
        variant = Variant("mqa", 1, uptrain=True)
        run._uptrain(o, SimpleNamespace(device="cpu"), assets, variant, student, out, store, Steps(1, print))

    store = ResultStore(tmp_path / "results")
    uptrain(True, tmp_path / "a", store)
    uptrain(False, tmp_path / "a", store)  # --no-progress: the same uptraining, reused
    assert calls == [False]
    # a run killed under --progress (no gqakit.json yet), run again under --no-progress, resumes
    uptrain(True, tmp_path / "b", store)
    (tmp_path / "b" / "gqakit.json").unlink()
    uptrain(False, tmp_path / "b", ResultStore(tmp_path / "other-results"))
    assert calls == [False, False, True]


@pytest.mark.parametrize("device", ["cpu", "cuda", "auto"])
def test_the_uptraining_recipes_name_the_device(tmp_path, device):
    from gqakit.pipelines.demo import run

    assets = DemoAssets(tmp_path / "m", tmp_path / "train.txt", tmp_path / "val.txt", tmp_path / "test.txt")
    o = DemoOptions(device=device, sets=TINY_RECIPE)
    for recipe in ("smollm2-135m-mqa", "smollm2-135m-mqa-refined"):
        loaded = run.load_demo_recipe(o, assets, tmp_path / "s", tmp_path / "m", tmp_path / "out", recipe)
        assert loaded.speed.device == device  # "auto": where accelerate puts it


def test_the_demo_times_decoding_again_on_another_cpu_model(tmp_path, monkeypatch):
    """Decode timings are keyed by the device's model, not its kind: a working directory moved to another
    machine measures them again, and the same machine reuses them."""
    from types import SimpleNamespace

    import gqakit.models as devices
    from gqakit.eval import DecodePoint
    from gqakit.pipelines.demo import measure as decode
    from gqakit.pipelines.demo.measure import Settings
    from gqakit.pipelines.steps import Steps
    from gqakit.pipelines.store import ResultStore

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=4)
    point = DecodePoint(batch=1, context=8, new_tokens=2, decode_ms=50.0, tokens_per_s=20.0)
    runs: list[int] = []

    def rounds(paths, **kwargs):
        runs.append(1)
        return [[point] for _ in paths]

    monkeypatch.setattr(decode, "decode_rounds", rounds)
    s = Settings("cpu", "float32", 16, None, 1, 8, 2, 1, ppl_batch=1)
    evals = [SimpleNamespace(label="m", result=SimpleNamespace(path=str(model)))]
    store = ResultStore(tmp_path / "results")
    monkeypatch.setattr(devices, "cpu_model", lambda: "AMD EPYC 7B13")
    for _ in range(2):
        decode.decode_side_by_side(evals, s, store, Steps(1, lambda *a, **k: None))
    assert len(runs) == 1  # the same machine reuses its timings
    monkeypatch.setattr(devices, "cpu_model", lambda: "Intel(R) Xeon(R) Platinum 8480+")
    decode.decode_side_by_side(evals, s, store, Steps(1, lambda *a, **k: None))
    assert len(runs) == 2
