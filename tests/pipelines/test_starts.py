"""Starts named as ``gqakit convert`` names them (a preset or a method), the conversion settings ``--set``
passes to the starts that use them, and the cache key of a start's conversion."""

from __future__ import annotations

import pytest

from gqakit.convert import PRESETS, ConvertOptions
from gqakit.errors import GqakitError
from gqakit.pipelines.starts import CONVERT, STARTS, conversion_key, convert_options_for, split_sets


def _opts(start: str, **settings) -> ConvertOptions:
    sets = [f"{CONVERT}{k}={v}" for k, v in settings.items()]
    return convert_options_for(start, 1, calib_data="calib.txt", sets=sets)


def test_the_starts_are_the_presets_then_the_other_methods():
    assert STARTS.names == ("mean", "fast", "best", "first", "random", "calibrated")
    assert STARTS["fast"] == PRESETS["fast"].summary


def test_the_fast_preset_is_the_demos_calibrated_and_refined_conversion():
    fast = _opts("fast")
    assert fast.preset == "fast" and fast.calib_data == "calib.txt"
    r = fast.resolved()
    assert (r.method, r.calib_tokens, r.refine_steps, r.refine_target) == (
        "calibrated",
        4096,
        200,
        "attention",
    )
    best = _opts("best").resolved()
    assert (best.calib_tokens, best.refine_steps, best.refine_target) == (49152, 1600, "layer-corrective")


def test_starts_that_read_no_text_get_none():
    assert _opts("mean").calib_data is None and _opts("first").calib_data is None
    assert _opts("calibrated").calib_data == "calib.txt" and not _opts("calibrated").resolved().refine_steps


def test_a_setting_goes_to_the_starts_that_use_it():
    assert conversion_key(_opts("mean", calib_tokens=512, refine_steps=5)) == conversion_key(_opts("mean"))
    cal = _opts("calibrated", calib_tokens=512, refine_steps=5).resolved()
    assert cal.calib_tokens == 512 and cal.refine_steps == 0  # a merge stays unrefined
    fast = _opts("fast", calib_tokens=512, refine_steps=5).resolved()
    assert (fast.calib_tokens, fast.refine_steps) == (512, 5)


def test_a_preset_keys_as_the_settings_it_stands_for():
    same = convert_options_for(
        "calibrated", 1, calib_data="calib.txt", sets=[f"{CONVERT}refine_steps=200"]
    )  # a method start takes no refinement: the same settings as fast only through the preset
    assert conversion_key(same) != conversion_key(_opts("fast"))
    explicit = ConvertOptions(1, method="calibrated", calib_data="calib.txt", refine_steps=200, force=True)
    assert conversion_key(explicit) == conversion_key(_opts("fast"))


def test_the_seed_keys_only_conversions_that_draw_at_random():
    def key(start: str, seed: int) -> dict:
        return conversion_key(convert_options_for(start, 1, calib_data="c.txt", seed=seed))

    assert key("mean", 1) == key("mean", 0) and key("calibrated", 1) == key("calibrated", 0)
    assert key("random", 1) != key("random", 0) and key("fast", 1) != key("fast", 0)


def test_split_sets_separates_the_conversion_settings():
    convert, recipe = split_sets(["train.lr=3e-4", "model.convert.calib_tokens=512"])
    assert convert == {"calib_tokens": 512} and recipe == ["train.lr=3e-4"]
    with pytest.raises(GqakitError, match="model.convert.preset=best"):
        split_sets(["model.convert.preset=best"])
