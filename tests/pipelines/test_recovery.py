"""``gqakit recovery`` on a tiny model: the curve arithmetic (evaluation points, thresholds, savings), the
whole pipeline with its cache, and the bad-input messages, each given before any conversion."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import TINY_TEXT, save_tiny_model

from gqakit.cli import main
from gqakit.errors import GqakitError
from gqakit.pipelines.recovery.curves import (
    Reach,
    Saving,
    eval_steps,
    saving,
    tokens_to_reach,
)
from gqakit.pipelines.recovery.options import RecoveryOptions
from gqakit.pipelines.recovery.run import run_recovery
from gqakit.problems import check_options
from gqakit.storage import working_directory

# ------------------------------------------------------------------------------------ curve arithmetic


def test_eval_steps_are_log_spaced_from_the_first_step_to_the_last():
    steps = eval_steps(200, 4)
    assert steps[0] == 1 and steps[-1] == 200 and steps == sorted(set(steps))
    ratios = [b / a for a, b in zip(steps[3:], steps[4:], strict=False)]
    assert all(1.5 < r < 2.0 for r in ratios), ratios  # about 10 ** (1/4) apart once past rounding
    assert len(eval_steps(2000, 4)) > len(steps)
    assert eval_steps(1, 4) == [1]


def test_tokens_to_reach_interpolates_in_log_tokens():
    curve = [(0, 10.0), (100, 4.0), (1000, 1.0)]
    # 2x is two thirds of the way from 4.0 to 1.0 between 100 and 1,000 tokens, on a log axis
    assert tokens_to_reach(curve, 2.0) == Reach(pytest.approx(100 * 10 ** (2 / 3)), "=")
    assert tokens_to_reach(curve, 1.0).tokens == pytest.approx(1000)
    assert tokens_to_reach(curve, 0.9) == Reach(1000, ">")
    assert tokens_to_reach(curve, 5.0) == Reach(100, "<=")  # crossed before the first measured point
    assert tokens_to_reach([(0, 1.01), (10, 1.0)], 1.05) == Reach(0, "=")
    assert tokens_to_reach(curve, 0.9).label() == "> 1,000"


def test_savings_are_exact_lower_bounds_or_not_applicable():
    assert saving(Reach(100, "="), Reach(1000, "=")).label() == "10.0x"
    lower = saving(Reach(100, "="), Reach(5000, ">"))  # the reference never got there
    assert lower.factor == pytest.approx(50) and lower.label() == ">= 50.0x"
    assert saving(Reach(100, ">"), Reach(1000, "=")).label() == "n/a"
    assert saving(Reach(0, "="), Reach(1000, "=")).label() == "no uptraining needed"
    assert saving(Reach(256, "<="), Reach(1000, "=")).label() == ">= 3.9x"
    # both got there by their first point: both counts are upper bounds, so either may be the faster
    assert saving(Reach(128, "<="), Reach(128, "<=")) == Saving(None, "n/a")
    assert saving(Reach(100, "="), Reach(128, "<=")) == Saving(None, "n/a")


# ------------------------------------------------------------------------------------ the pipeline


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recovery")
    sentences = [s.strip() + "." for s in TINY_TEXT.split(".") if s.strip()]
    rng = random.Random(0)
    data = root / "data.txt"
    data.write_text("\n".join(" ".join(rng.sample(sentences, 4)) for _ in range(400)) + "\n")
    return {"src": save_tiny_model(root / "src", "llama", heads=4, kv_heads=4), "data": data}


# The runs' recipe and the starts' conversions shrunk to the tiny model, through --set.
TINY_SETS = (
    "objective.kind=lm", "train.precision=fp32", "data.seq_len=32", "train.batch_size=4",
    "data.max_val_blocks=8", "checkpoint.every=3", "model.convert.calib_tokens=2048",
    "model.convert.refine_steps=5",
)  # fmt: skip


def options(tiny, tmp_path: Path, messages: list[str], *more_sets: str, **kw) -> RecoveryOptions:
    base = dict(
        src=str(tiny["src"]), groups=1, data=tiny["data"], tokens=1024, starts=("mean", "random", "fast"),
        lr=1e-2, sets=(*TINY_SETS, "train.warmup_fraction=0.125", *more_sets), device="cpu",
        out=tmp_path / "report", work_dir=tmp_path / "work", progress=False, echo=messages.append,
    )  # fmt: skip
    return RecoveryOptions(**{**base, **kw})


def test_recovery_measures_each_start_and_a_rerun_reuses_everything(tiny, tmp_path, capfd, caplog):
    messages: list[str] = []
    with caplog.at_level(logging.INFO, logger="gqakit"):
        first = run_recovery(options(tiny, tmp_path, messages))
    # one line per step (and its results): no bars (progress=False), no library chatter, no log line
    # repeating a step, on the terminal or in the log
    assert capfd.readouterr().err == ""
    assert not [r for r in caplog.records if r.name.startswith("gqakit") and r.levelno < logging.WARNING]
    assert [m.split("]")[0] for m in messages if m.startswith("[")] == [f"[{k}/6" for k in range(1, 7)]
    assert all(m.startswith(("gqakit recovery:", "[", "      ", "Report:")) for m in messages), messages
    assert len(messages) == len(set(messages))

    results = json.loads(first.results_json.read_text())
    assert list(results["starts"]) == ["mean", "random", "fast"] and results["reference"] == "mean"
    steps = [0, *eval_steps(8, 4)]  # 8 steps of 128 tokens: the start, then log-spaced points
    for start, curve in results["starts"].items():
        assert [p["tokens"] for p in curve["points"]] == [s * 128 for s in steps]
        ppl = [p["ppl"] for p in curve["points"]]
        assert ppl[-1] < ppl[0], (start, ppl)  # uptraining recovers
        ratio = curve["points"][-1]["ratio"]
        assert ratio == pytest.approx(ppl[-1] / results["original_ppl"])
        assert set(curve["reach"]) == {"2", "1.5", "1.2", "1.1", "1.05"}
    assert {s["lr"] for s in results["starts"].values()} == {1e-2}
    assert set(results["savings"]) == {"random", "fast"}
    # the start's own perplexity is the converted model's; mean pooling's is worse than the original's
    assert results["starts"]["mean"]["points"][0]["ratio"] > 1
    assert first.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = first.report.read_text()
    assert "| start | at 0 tokens | at 1,024 tokens | 2x | 1.5x | 1.2x | 1.1x | 1.05x |" in report
    assert "## Savings over mean" in report

    # A rerun with only progress and echo changed computes nothing and reports the first run's time.
    again: list[str] = []
    second = run_recovery(options(tiny, tmp_path, again, "checkpoint.every=5"))
    assert json.loads(second.results_json.read_text())["starts"] == results["starts"]
    assert second.elapsed_s < first.elapsed_s / 3
    figures = [ln for ln in second.report.read_text().splitlines() if "runs took" in ln]
    assert figures == [ln for ln in first.report.read_text().splitlines() if "runs took" in ln]

    # Another shared rate or length reruns the uptraining, not the original's evaluation.
    original = tmp_path / "work" / "results" / "original.json"
    stamp = original.stat().st_mtime_ns
    fourth = run_recovery(options(tiny, tmp_path, [], starts=("mean",), lr=5e-3, tokens=512))
    assert original.stat().st_mtime_ns == stamp and fourth.original_ppl == first.original_ppl
    assert "Only one start was run: nothing to compare it with" in fourth.report.read_text()

    # A conversion setting changes the starts that use it only, and the report names it.
    fifth = run_recovery(
        options(tiny, tmp_path, [], "model.convert.calib_tokens=1024", starts=("mean", "fast"))
    )
    res5 = json.loads(fifth.results_json.read_text())
    assert res5["starts"]["mean"]["points"] == results["starts"]["mean"]["points"]
    assert res5["starts"]["fast"]["points"][0] != results["starts"]["fast"]["points"][0]
    assert res5["settings"]["starts"]["fast"]["calib_tokens"] == 1024
    assert "calib_tokens 1024" in fifth.report.read_text()


def _points(result) -> dict[str, list]:
    return {s: c["points"] for s, c in json.loads(result.results_json.read_text())["starts"].items()}


def test_another_data_file_in_the_same_work_dir_is_measured_afresh(tiny, tmp_path, monkeypatch):
    rng = random.Random(1)
    other = tmp_path / "numbers.txt"  # text unlike tiny["data"]: every figure it gives differs
    other.write_text("\n".join(" ".join(str(rng.randrange(10**6)) for _ in range(30)) for _ in range(400)))
    kw = dict(starts=("mean", "calibrated"), tokens=512)
    first = run_recovery(options(tiny, tmp_path, [], **kw))
    first_points = _points(first)  # read now: each run rewrites the same report
    second = run_recovery(options(tiny, tmp_path, [], data=other, **kw))
    second_points = _points(second)
    alone = run_recovery(options(tiny, tmp_path / "alone", [], data=other, **kw))  # its own work dir
    assert second.original_ppl != first.original_ppl and second.original_ppl == alone.original_ppl
    assert second_points == _points(alone) and second_points != first_points
    # the same data again reuses all 6: the split, the original's evaluation, 2 conversions, 2 runs
    again = run_recovery(options(tiny, tmp_path, [], data=other, **kw))
    assert _points(again) == second_points
    assert "(6 results reused from" in again.report.read_text()

    # A run killed on one file does not resume on another from its checkpoint (same recipe, same paths).
    from gqakit.uptrain import train

    save = train.save_checkpoint

    def die_after_first_checkpoint(run):
        save(run)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(train, "save_checkpoint", die_after_first_checkpoint)
        with pytest.raises(KeyboardInterrupt):
            run_recovery(options(tiny, tmp_path, [], starts=("mean",), tokens=512))
    after = run_recovery(options(tiny, tmp_path, [], data=other, starts=("mean",), tokens=512))
    assert _points(after)["mean"] == _points(alone)["mean"]
    history = (tmp_path / "work" / "runs" / "mean" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(h)["step"] for h in history if '"loss"' in h] == [1, 2, 3, 4]  # run whole, once


def test_the_warmup_is_ten_steps_or_half_a_shorter_run(tiny, tmp_path):
    assert RecoveryOptions(src="x", groups=1, tokens=16384).warmup_run == 8
    assert RecoveryOptions(src="x", groups=1, tokens=204800).warmup_run == 10
    o = options(tiny, tmp_path, [], starts=("mean",), tokens=512)
    result = run_recovery(RecoveryOptions(**{**o.__dict__, "sets": TINY_SETS}))
    history = (tmp_path / "work" / "runs" / "mean" / "metrics.jsonl").read_text().splitlines()
    lrs = [json.loads(h)["lr"] for h in history if '"loss"' in h]
    assert lrs == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2])  # 4 steps: a warmup of 2
    assert "a warmup of 2 steps" in result.report.read_text().replace("\n", " ")
    assert json.loads(result.results_json.read_text())["settings"]["warmup_steps_run"] == 2


def test_a_killed_run_resumes_from_its_checkpoint(tiny, tmp_path, monkeypatch):
    from gqakit.uptrain import train

    opts = options(tiny, tmp_path, [], starts=("mean",))
    save = train.save_checkpoint
    calls = []

    def die_after_first_checkpoint(run):
        save(run)
        calls.append(run.state.step)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(train, "save_checkpoint", die_after_first_checkpoint)
        with pytest.raises(KeyboardInterrupt):
            run_recovery(opts)
    assert calls == [3]
    resumed = run_recovery(opts)
    history = (tmp_path / "work" / "runs" / "mean" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(h)["step"] for h in history if '"loss"' in h]
    assert steps == list(range(1, 9))  # steps 1-3 kept, 4-8 trained after the resume
    # the run's time is the resumed attempt's (a kill keeps nothing of the time of the step it ended)
    assert json.loads(resumed.results_json.read_text())["starts"]["mean"]["train_s"] > 0
    whole = run_recovery(options(tiny, tmp_path / "whole", [], starts=("mean",)))
    a = json.loads(resumed.results_json.read_text())["starts"]["mean"]["points"]
    b = json.loads(whole.results_json.read_text())["starts"]["mean"]["points"]
    assert [p["ppl"] for p in a] == pytest.approx([p["ppl"] for p in b], rel=1e-5)


def test_device_cpu_on_a_gpu_machine_evaluates_and_uptrains_on_the_cpu(tiny, tmp_path, gpu_machine):
    res = run_recovery(options(tiny, tmp_path, [], "checkpoint.every=0", starts=("mean",), tokens=256))
    assert res.curves[0].points[-1][1] > 1  # it ran: on CUDA (make-believe here) it would have failed
    prov = json.loads((tmp_path / "work" / "runs" / "mean" / "gqakit.json").read_text())
    assert prov["recipe"]["speed"]["device"] == "cpu"


def test_the_uptraining_recipe_names_the_device_and_its_cache_key_does_not(tiny, tmp_path):
    from gqakit.pipelines.recovery.run import Inputs, run_recipe
    from gqakit.pipelines.steps import weights_key

    inputs = Inputs(str(tiny["src"]), tiny["data"], tiny["data"], tiny["data"])
    keys = []
    for device in ("cpu", "cuda", "auto"):
        o = options(tiny, tmp_path, [], device=device)
        recipe = run_recipe(o, inputs, str(tiny["src"]), tmp_path / "out")
        assert recipe.speed.device == device  # "auto": where accelerate puts it
        keys.append(weights_key(recipe.to_dict()))
    assert keys[0] == keys[1] == keys[2]  # runs cached before the device was passed stay valid


# ------------------------------------------------------------------------------------ bad input


def _cli(tiny, tmp_path, *args: str):
    base = ["recovery", str(tiny["src"]), "--data", str(tiny["data"]), "--work-dir", str(tmp_path / "w")]
    return CliRunner().invoke(main, [*base, "--out", str(tmp_path / "o"), *args])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--groups", "1", "--starts", "mean,fsat"], "--starts fsat: unknown start; choose from"),
        (["--groups", "1", "--set", "model.convert.method=first"], "--set 'model.convert.method=first'"),
        (["--groups", "1", "--set", "train.lr=fast"], "train.lr"),
        (["--groups", "1", "--tokens", "100"], "--tokens 100 is smaller than the first evaluation point"),
        (["--groups", "3"], "--groups 3 does not divide the 4 K/V heads of this checkpoint. Valid --groups"),
        (
            ["--groups", "1", "--lr", "inf"],
            "--lr must be a finite learning rate above 0, got inf; e.g. 0.0002 (the default).",
        ),
        (
            ["--groups", "1", "--lr", "nan"],
            "--lr must be a finite learning rate above 0, got nan; e.g. 0.0002 (the default).",
        ),
    ],
)
def test_bad_input_is_one_clear_message_before_any_conversion(tiny, tmp_path, args, message):
    result = _cli(tiny, tmp_path, *args)
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert not (tmp_path / "w" / "models").exists() and not (tmp_path / "o").exists()


def test_unknown_start_suggests_the_closest(tiny, tmp_path):
    assert 'did you mean "fast"' in _cli(tiny, tmp_path, "--groups", "1", "--starts", "fsat").output.lower()


def test_an_unwritable_output_is_refused_before_any_work(tiny, tmp_path):
    (tmp_path / "afile").write_text("a file")
    base = ["recovery", str(tiny["src"]), "--groups", "1", "--data", str(tiny["data"])]
    out = str(tmp_path / "afile" / "report")
    result = CliRunner().invoke(main, [*base, "--work-dir", str(tmp_path / "w"), "--out", out])
    assert result.exit_code != 0
    assert f"--out {out} cannot be written (Not a directory)" in result.output, result.output
    assert not (tmp_path / "w").exists()


def test_a_working_directory_another_run_holds_is_refused_before_any_work(tiny, tmp_path):
    with working_directory(tmp_path / "w"):  # as a recovery run still going holds it
        result = _cli(tiny, tmp_path, "--groups", "1", "--starts", "mean")
    assert result.exit_code != 0
    assert f"--work-dir {tmp_path / 'w'} is in use by another run (pid {os.getpid()} " in result.output
    assert not (tmp_path / "w" / "models").exists() and not (tmp_path / "o").exists()


def test_options_from_python_name_the_flags():
    with pytest.raises(GqakitError, match="--tokens 10 is smaller"):
        check_options(RecoveryOptions(src="x", groups=1, tokens=10), "recovery")
    with pytest.raises(GqakitError) as e:
        check_options(RecoveryOptions(src="x", groups=1, lr=float("inf")), "recovery")
    assert (
        "--lr must be a finite learning rate above 0, got inf; e.g. 0.0002 (the default)." in e.value.message
    )


def test_a_start_a_retargeted_family_cannot_take_is_refused_before_any_conversion(tiny, tmp_path):
    src = save_tiny_model(tmp_path / "gpt2", "gpt2", heads=4, kv_heads=4)
    base = ["recovery", str(src), "--groups", "2", "--data", str(tiny["data"]), "--starts", "mean,best"]
    result = CliRunner().invoke(
        main, [*base, "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code != 0
    assert "gpt_bigcode holds only G = 1 (multi_query) or G = 4 heads; choose one of 1, 4" in (
        result.output
    ), result.output
    assert not (tmp_path / "w" / "models").exists() and not (tmp_path / "o").exists()


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "data.seq_len=1000", "--tokens", "4000"],
            "--set data.seq_len 1000 is more than this model's 256 positions (SRC {src}: "
            "max_position_embeddings); use --set data.seq_len=256 or less.",
        ),
        (["--groups", "3"], "--groups 3 does not divide the 4 K/V heads of this checkpoint"),
        (["--data", "{latin1}"], "--data {latin1} is not UTF-8 text"),
        (["--data", "{short}"], "--data {short} has 5 non-empty lines (documents): too few to hold out"),
        (
            ["--starts", "mean,fast", "--set", "model.convert.calib_tokens=16"],
            "--refine-steps needs at least 2",
        ),
    ],
)
def test_the_source_and_the_data_are_checked_before_the_work_dir_is_created(tiny, tmp_path, args, message):
    """G, the family, the model's positions and the --data text are refused with one message before
    anything is written: no working directory, no split, no pending file, no report folder."""
    files = {"latin1": tmp_path / "in" / "latin1.txt", "short": tmp_path / "in" / "short.txt"}
    files["latin1"].parent.mkdir()
    files["latin1"].write_bytes("caf\xe9 au lait\n".encode("latin-1") * 40)
    files["short"].write_text("one document\n" * 5)
    names = {"src": tiny["src"], **files}
    before = _listing(tmp_path)
    argv = ["--groups", "1", "--starts", "mean", *args]
    result = _cli(tiny, tmp_path, *[a.format(**names) for a in argv])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert message.format(**names) in " ".join(result.output.split()), result.output
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("written", [None, "cpu"])  # before recipes held speed.device; another --device
def test_a_killed_run_resumes_under_another_device_or_from_an_older_recipe(tmp_path, monkeypatch, written):
    """speed (the levers, the device) changes how a run goes, not what it trains: a killed run resumes,
    its checkpoints kept, rather than starting over (uptrain(force=True) deletes them)."""
    import time

    import gqakit.pipelines.recovery.run as rec
    from gqakit.pipelines import steps as run_keys
    from gqakit.pipelines.recovery.run import Inputs
    from gqakit.pipelines.store import ResultStore

    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4)
    text = tmp_path / "t.txt"
    text.write_text("\n".join([TINY_TEXT] * 20))
    inputs = Inputs(str(src), text, text, text)
    o = RecoveryOptions(src=str(src), groups=2, tokens=2048, sets=("data.seq_len=32",), device="auto")
    runs = tmp_path / "runs"
    out = runs / "mean"
    (out / "checkpoints" / "step-00000010").mkdir(parents=True)
    recipe = rec.run_recipe(o, inputs, str(src), out)
    recipe.speed.device = written or "auto"
    saved = recipe.to_yaml()
    if written is None:  # as a gqakit before speed.device wrote it
        assert "  device: auto\n" in saved
        saved = saved.replace("  device: auto\n", "")
    (out / "recipe.yaml").write_text(saved)
    later = time.time() + 5
    os.utime(out / "recipe.yaml", (later, later))  # the run started after its inputs were written
    calls: list[tuple[bool, bool]] = []

    def uptrain(recipe, resume, force):
        calls.append((resume, force))
        raise KeyboardInterrupt  # enough: how it was called

    monkeypatch.setattr(run_keys, "uptrain", uptrain)
    with pytest.raises(KeyboardInterrupt):
        rec.uptrain_start(o, ResultStore(tmp_path / "results"), inputs, "mean", src, runs)
    assert calls == [(True, False)]
