"""The cache key of a start's conversion (``gqakit.pipelines.starts.conversion_key``)."""

from __future__ import annotations

from gqakit.convert.options import ConvertOptions
from gqakit.convert.refine import REFINE_QK_LR
from gqakit.pipelines.starts import conversion_key, start_convert_options


def _opts(start: str, **kw) -> ConvertOptions:
    args = {"calib_data": "calib.txt", "calib_tokens": 4096, "refine_steps": 200, **kw}
    return start_convert_options(start, 1, **args)


def test_mean_pooling_is_keyed_the_same_whatever_the_calibration_and_refinement_budget():
    assert conversion_key(_opts("mean")) == {"groups": 1}
    assert conversion_key(_opts("mean", calib_tokens=32768, refine_steps=800)) == {"groups": 1}


def test_the_seed_keys_only_conversions_that_draw_at_random():
    # a recovery run with --seed 1 reuses mean pooling and the unrefined merge, not random heads or
    # a refinement (its seed orders the calibration batches)
    assert conversion_key(_opts("mean", seed=1)) == {"groups": 1}
    assert conversion_key(_opts("calibrated", seed=1)) == conversion_key(_opts("calibrated"))
    assert conversion_key(_opts("random", seed=1))["seed"] == 1
    assert conversion_key(_opts("refined", seed=1))["seed"] == 1


def test_the_calibrated_and_refined_keys_change_with_their_budgets():
    cal = conversion_key(_opts("calibrated"))
    assert cal == {"groups": 1, "method": "calibrated", "calib_data": "calib.txt"}
    assert conversion_key(_opts("calibrated", calib_tokens=32768))["calib_tokens"] == 32768
    assert conversion_key(_opts("calibrated", refine_steps=800)) == cal  # not refined: steps unused
    refined = conversion_key(_opts("refined", refine_steps=800))
    assert refined["refine_steps"] == 800


def test_a_refined_conversion_at_the_new_query_key_rate_misses_caches_keyed_before_it_was_the_default():
    # keys written when refine_qk_lr defaulted to None held no refine_qk_lr: a conversion at today's
    # default must not match them, and one asking for the old behaviour must
    today = conversion_key(_opts("refined"))
    assert today["refine_qk_lr"] == REFINE_QK_LR
    old = _opts("refined")
    old = ConvertOptions(**{**old.__dict__, "refine_qk_lr": None})
    assert "refine_qk_lr" not in conversion_key(old)


def test_the_refinement_options_key_the_refined_start_only():
    refine = {"refine_target": "layer-corrective", "refine_schedule": "cosine", "refine_loss": "per-token"}
    key = conversion_key(_opts("refined", refine=refine))
    assert {k: key[k] for k in refine} == refine
    # the defaults keep cached starts valid
    assert not set(refine) & set(conversion_key(_opts("refined", refine={"refine_loss": "relative"})))
    assert conversion_key(_opts("calibrated", refine=refine)) == conversion_key(_opts("calibrated"))


def test_the_loss_is_keyed_as_used():
    # a whole-layer target's own loss (per-token) is keyed by its name, so conversions cached when that
    # target fitted with the relative loss (keyed without one) miss, and naming it changes nothing
    layer = {"refine_target": "layer-corrective"}
    own = conversion_key(_opts("refined", refine=layer))
    assert own["refine_loss"] == "per-token"
    assert own == conversion_key(_opts("refined", refine={**layer, "refine_loss": "per-token"}))
    assert "refine_loss" not in conversion_key(_opts("refined", refine={**layer, "refine_loss": "relative"}))
