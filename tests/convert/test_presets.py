"""Presets and convert's options: each preset's fields, an explicit option over a preset's, gqakit.json
recording the preset, the wiki-en default text, ``--set`` and its errors, and the line of a refinement
that kept no step."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner
from tiny_models import TINY_TEXT

from gqakit.cli import main
from gqakit.convert import PRESETS, ConvertOptions, convert_checkpoint
from gqakit.convert.refine import REFINE_LR, REFINE_QK_LR
from gqakit.errors import GqakitError


@pytest.fixture(scope="module")
def calib_txt(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(" ".join(random.Random(1).choices(TINY_TEXT.split(), k=2000)))
    return path


def _convert(*args: str):
    return CliRunner().invoke(main, ["convert", *args])


def test_each_preset_is_one_row_of_settings():
    rows = {name: PRESETS[name] for name in PRESETS}
    assert list(rows) == ["mean", "fast", "best"]
    assert (rows["mean"].method, rows["mean"].refine_steps, rows["mean"].needs_text) == ("mean", 0, False)
    fast, best = rows["fast"], rows["best"]
    assert (fast.method, fast.calib_tokens, fast.refine_steps, fast.refine_target) == (
        "calibrated",
        4096,
        200,
        "attention",
    )
    assert (best.method, best.calib_tokens, best.refine_steps, best.refine_target) == (
        "calibrated",
        49152,
        1600,
        "layer-corrective",
    )
    for row in (fast, best):
        assert row.needs_text and (row.refine_lr, row.refine_qk_lr) == (REFINE_LR, REFINE_QK_LR)


def test_an_explicit_field_beats_the_preset_which_beats_the_default():
    plain = ConvertOptions(2).resolved()
    assert (plain.preset, plain.method, plain.refine_steps) == ("mean", "mean", 0)
    fast = ConvertOptions(1, preset="fast", refine_steps=3, refine_lr=2e-3).resolved()
    assert (fast.method, fast.calib_tokens, fast.refine_steps) == ("calibrated", 4096, 3)
    assert fast.refine_lr == 2e-3
    assert fast.refine_qk_lr == REFINE_QK_LR and fast.resolved() == fast
    assert ConvertOptions(1, preset="best", method="mean").resolved().refine_target == "layer-corrective"


def test_a_preset_conversion_records_the_preset_and_its_resolved_settings(tiny_llama, tmp_path, calib_txt):
    dst = tmp_path / "fast"
    res = _convert(
        str(tiny_llama), str(dst), "-g", "1", "--preset", "fast", "--calib-data", str(calib_txt),
        "--calib-tokens", "512", "--refine-steps", "4", "--set", "seed=3",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "(preset fast, calibrated, " in res.output
    prov = json.loads((dst / "gqakit.json").read_text())
    assert prov["preset"] == "fast" and prov["method"] == "calibrated"
    assert prov["settings"] == {
        "method": "calibrated",
        "calib_tokens": 512,  # the explicit options, over the preset's 4,096 and 200
        "refine_steps": 4,
        "refine_target": "attention",
        "refine_lr": REFINE_LR,
        "refine_qk_lr": REFINE_QK_LR,
    }
    assert prov["refine"]["steps"] == 4 and prov["refine"]["seed"] == 3
    assert prov["calibration"]["tokens"] == 512


def test_a_preset_without_text_calibrates_on_wiki_en_and_says_so(
    tiny_llama, tmp_path, calib_txt, monkeypatch, capsys
):
    import gqakit.assets

    fetched = []

    def fetch(name, *a, **kw):
        fetched.append(name)
        return {"train": calib_txt}

    monkeypatch.setattr(gqakit.assets, "fetch_asset", fetch)
    opts = ConvertOptions(1, preset="fast", calib_tokens=512, refine_steps=2)
    res = convert_checkpoint(tiny_llama, tmp_path / "o", opts, progress=False)
    assert fetched == ["wiki-en"]
    err = capsys.readouterr().err
    assert "needs calibration text and no --calib-data was given: calibrating on the wiki-en asset's" in err
    assert res.provenance["calibration"]["path"] == str(calib_txt.resolve())
    # without a preset that needs text, a method that needs it still asks for --calib-data
    with pytest.raises(GqakitError, match="--method calibrated needs calibration text: give --calib-data"):
        convert_checkpoint(tiny_llama, tmp_path / "p", ConvertOptions(1, method="calibrated"))
    assert fetched == ["wiki-en"] and not (tmp_path / "p").exists()


def test_set_errors_are_reported_together_with_the_other_problems(tiny_llama, tmp_path):
    res = _convert(
        str(tiny_llama), str(tmp_path / "o"), "-g", "0", "--set", "refine_targt=layer-corrective",
        "--set", "method=first", "--set", "seed", "--set", "seed=abc", "--set", "refine_target=window",
        "--set", "grouping=similarity",
    )  # fmt: skip
    assert res.exit_code != 0
    out = " ".join(res.output.split())
    assert "'refine_targt' is no setting." in out and "Known: refine_target, refine_lr" in out
    assert "'grouping' is no setting." in out  # similarity grouping was removed
    assert 'Did you mean "refine_target"?' in out
    assert "--set 'method=first': method has an option of its own, --method." in out
    assert "--set 'seed' is not NAME=VALUE" in out
    assert "--set 'seed=abc': seed takes a whole number, got 'abc'." in out
    assert "--set refine_target 'window' is unknown; choose one of attention, layer-corrective." in out
    assert "--groups must be a positive number of K/V heads, got 0." in out
    assert not (tmp_path / "o").exists()


def test_a_refinement_that_keeps_no_step_says_so(tiny_llama, tmp_path, calib_txt):
    """A rate far too high: every layer keeps its merge, and the line and gqakit.json say so."""
    dst = tmp_path / "o"
    res = _convert(
        str(tiny_llama), str(dst), "-g", "1", "--method", "calibrated", "--calib-data", str(calib_txt),
        "--calib-tokens", "512", "--refine-steps", "3", "--set", "refine_lr=50", "--set", "refine_qk_lr=50",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "refinement kept no step" in res.output and "refined 3 steps" not in res.output
    rec = json.loads((dst / "gqakit.json").read_text())["refine"]
    assert all(layer["best_step"] == 0 for layer in rec["attention_error"])
    assert rec["summary"].startswith("refinement kept no step: in 3 steps/layer no layer's held-out error")


def test_convert_help_lists_at_most_twelve_options():
    res = CliRunner().invoke(main, ["convert", "--help"])
    assert res.exit_code == 0
    flags = [line.split()[0] for line in res.output.splitlines() if line.strip().startswith("-")]
    assert len(flags) <= 12, flags
    assert "--preset" in res.output and "--set" in res.output and "--refine-target" not in res.output
