"""Recipes: every shipped YAML validates, overrides apply, and every kind of bad input is one clear error."""

from __future__ import annotations

import pytest

from gqakit.errors import GqakitError
from gqakit.uptrain.recipe import RECIPES_DIR, RecipeError, load_recipe
from gqakit.uptrain.schedule import Budget, lr_multiplier, resolve_budget

TINY_RECIPE = RECIPES_DIR / "tiny.yaml"


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES_DIR.glob("*.yaml")))
def test_every_shipped_recipe_parses_and_validates(name):
    text = (RECIPES_DIR / name).read_text()
    assert text.lstrip().startswith("#"), "a recipe opens with the command that runs it"
    assert "gqakit uptrain" in text.split("\n\n")[0] or "-m gqakit.uptrain" in text.split("\n\n")[0]
    recipe = load_recipe(RECIPES_DIR / name)
    assert recipe.budget.steps or recipe.budget.tokens or recipe.budget.alpha


def test_shipped_recipe_by_bare_name():
    assert load_recipe("tiny").data.seq_len == 32


def test_overrides_nested_lists_null_and_scientific_numbers():
    r = load_recipe(
        TINY_RECIPE,
        [
            "train.lr=3e-4",
            "data.files=[a.txt, b.txt]",
            "teacher=null",
            "budget.steps=null",
            "budget.alpha=0.05",
            "budget.pretraining_tokens=2e12",
            "model.convert.groups=1",
        ],
    )
    assert r.train.lr == 3e-4 and r.data.files == ["a.txt", "b.txt"] and r.teacher is None
    assert r.budget.pretraining_tokens == 2_000_000_000_000 and isinstance(r.budget.pretraining_tokens, int)
    assert r.model.convert.groups == 1


def test_overrides_leave_the_callers_dict_unchanged():
    import copy

    import yaml

    from gqakit.uptrain.recipe import recipe_from_dict

    data = yaml.safe_load(TINY_RECIPE.read_text())
    before = copy.deepcopy(data)
    r1 = recipe_from_dict(data, ["train.grad_accum=8", "train.lr=0.5", "model.convert.groups=1"])
    assert (r1.train.grad_accum, r1.train.lr, r1.model.convert.groups) == (8, 0.5, 1)
    assert data == before
    r2 = recipe_from_dict(data)  # no overrides: the file's values, not the last call's
    assert (r2.train.grad_accum, r2.train.lr, r2.model.convert.groups) == (1, 3e-3, 2)


def test_environment_variables_and_defaults_expand(monkeypatch):
    monkeypatch.setenv("GQAKIT_CACHE", "/data/cache")
    r = load_recipe(TINY_RECIPE, ["model.path=${GQAKIT_CACHE:-~/x}/m", "output_dir=${NOPE_UNSET:-/tmp/o}"])
    assert r.model.path == "/data/cache/m" and r.output_dir == "/tmp/o"


def test_every_problem_is_reported_at_once_with_known_keys():
    with pytest.raises(RecipeError) as e:
        load_recipe(TINY_RECIPE, ["train.lrr=1", "train.batch_size=big", "objective.kind=distil", "nonsense"])
    msg = str(e.value)
    assert len(e.value.problems) == 4, msg
    assert 'train.lrr: unknown key. Did you mean "lr"?' in msg and "Known keys in train: lr, betas" in msg
    assert "train.batch_size: expected an integer, got 'big'" in msg
    assert "objective.kind: 'distil' is not allowed." in msg and "lm, distill, mix" in msg
    assert "override 'nonsense' is not key=value" in msg


def test_cross_field_rules():
    with pytest.raises(RecipeError) as e:
        load_recipe(
            TINY_RECIPE,
            [
                "budget.tokens=100",
                "objective.kind=distill",
                "teacher=null",
                "budget.alpha=0.1",
                "train.lr=-1",
            ],
        )
    msg = str(e.value)
    assert "give exactly one of steps, tokens or alpha (got steps, tokens, alpha)" in msg
    assert "budget.alpha needs budget.pretraining_tokens" in msg
    assert "objective.kind 'distill' needs a teacher" in msg
    assert "train.lr must be a finite learning rate above 0, got" in msg


@pytest.mark.parametrize("lr", [".inf", ".nan"])
def test_a_learning_rate_that_is_not_finite_is_refused(tmp_path, lr):
    """YAML reads .inf and .nan; such a run only failed after its first steps (3 non-finite in a row)."""
    f = tmp_path / "r.yaml"
    f.write_text("model: {path: m}\nbudget: {steps: 1}\ndata: {files: [t.txt]}\noutput_dir: out\n")
    with pytest.raises(
        RecipeError,
        match=r"train.lr must be a finite learning rate above 0, got (inf|nan); e\.g\. 0\.0001 \(the "
        r"default\)\.",
    ):
        load_recipe(f, [f"train.lr={lr}"])


def test_missing_required_section(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("model: {path: m}\nbudget: {steps: 1}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(f)
    assert "data is required" in str(e.value) and "output_dir is required" in str(e.value)


def test_recipe_missing_not_yaml_not_a_mapping(tmp_path):
    with pytest.raises(GqakitError, match=r"does not exist\. .*shipped recipes .*tiny\.yaml"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(GqakitError, match="is not valid YAML"):
        load_recipe(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(GqakitError, match="must be a YAML mapping"):
        load_recipe(bad)


def test_budget_in_steps_tokens_and_alpha_agree():
    tps = 4 * 2 * 8 * 512  # batch 4, accum 2, 8 processes, seq_len 512
    r = load_recipe(TINY_RECIPE, ["budget.steps=null", "budget.alpha=0.05", "budget.pretraining_tokens=2e12"])
    b = resolve_budget(r.budget, tps)
    assert b.steps == -(-int(0.05 * 2e12) // tps) and b.alpha() == pytest.approx(0.05, rel=1e-6)
    assert (
        resolve_budget(
            load_recipe(TINY_RECIPE, ["budget.steps=null", "budget.tokens=1000"]).budget, 300
        ).steps
        == 4
    )
    assert "10 steps = 1,000 tokens = alpha 0.001 of 1e+06" in Budget(10, 100, 10**6).describe()


@pytest.mark.parametrize(
    ("alpha", "pretraining", "tokens_per_step", "steps"),
    [(0.07, 12800, 128, 7), (0.07, 100, 1, 7), (0.05, 2e12, 4 * 2 * 8 * 512, 3051758), (0.29, 100, 1, 29)],
)
def test_an_alpha_budget_that_is_whole_steps_on_paper_takes_exactly_those_steps(
    alpha, pretraining, tokens_per_step, steps
):
    over = ["budget.steps=null", f"budget.alpha={alpha}", f"budget.pretraining_tokens={pretraining}"]
    b = resolve_budget(load_recipe(TINY_RECIPE, over).budget, tokens_per_step)
    assert b.steps == steps  # 0.07 x 12,800 is 896 tokens = 7 steps of 128, not 896.0000000000001 -> 8


@pytest.mark.parametrize(("fraction", "steps", "warmup"), [(0.29, 100, 29), (0.57, 100, 57), (0.1, 15, 1)])
def test_warmup_is_the_exact_fraction_of_the_steps_rounded_down(fraction, steps, warmup):
    from gqakit.uptrain.schedule import warmup_steps

    assert warmup_steps(fraction, steps) == warmup  # 0.29 x 100 in floats is 28.999999999999996, not 28
    # the last warmup step still rises; the next is the peak
    assert lr_multiplier(warmup - 1, steps, warmup, 0.1) < 1.0 == lr_multiplier(warmup, steps, warmup, 0.1)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_multiplier(s, total=100, warmup=10, min_ratio=0.1) for s in range(101)]
    assert lrs[0] == pytest.approx(1 / 11) and lrs[9] == pytest.approx(10 / 11) and lrs[10] == 1.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[100] == pytest.approx(0.1)


@pytest.mark.parametrize("name", sorted(p.name for p in (RECIPES_DIR / "accelerate").glob("*.yaml")))
def test_every_accelerate_config_loads_in_accelerate(name):
    from accelerate.commands.config.config_args import ClusterConfig

    path = RECIPES_DIR / "accelerate" / name
    header = path.read_text().split("\n\n")[0]
    launch = ("accelerate launch --config_file", "--accelerate-config")
    assert any(f"{cmd} recipes/accelerate/{name}" in header for cmd in launch), header
    config = ClusterConfig.from_yaml_file(str(path))
    assert config.num_processes >= 1


def test_cli_prints_the_resolved_recipe_and_reports_problems_without_a_traceback():
    from click.testing import CliRunner

    from gqakit.uptrain.cli import uptrain_cmd

    ok = CliRunner().invoke(uptrain_cmd, [str(TINY_RECIPE), "train.lr=0.5", "--print-recipe"])
    assert ok.exit_code == 0 and "lr: 0.5" in ok.output
    # --set is the same override, in the pipelines' spelling; applied after the positional ones
    both = [str(TINY_RECIPE), "train.lr=0.5", "--set", "train.lr=0.25", "--set", "seed=3", "--print-recipe"]
    ok = CliRunner().invoke(uptrain_cmd, both)
    assert ok.exit_code == 0 and "lr: 0.25" in ok.output and "seed: 3" in ok.output
    bad = CliRunner().invoke(uptrain_cmd, [str(TINY_RECIPE), "train.lr=fast", "budget.step=3"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert (
        "train.lr: expected a number, got 'fast'" in bad.output and "budget.step: unknown key" in bad.output
    )


def test_convert_block_takes_calibrated_options_and_checks_them():
    r = load_recipe(
        TINY_RECIPE, ["model.convert={groups: 1, method: calibrated, calib_data: /data/calib.txt}"]
    )
    assert (r.model.convert.method, r.model.convert.calib_data) == ("calibrated", "/data/calib.txt")
    with pytest.raises(RecipeError) as e:
        load_recipe(TINY_RECIPE, ["model.convert={groups: 1, method: calibrated}"])
    assert "model.convert.method calibrated needs calibration text: give model.convert.calib_data" in str(
        e.value
    )


def test_convert_block_is_the_convert_options_and_checks_them():
    from gqakit.convert import ConvertOptions

    r = load_recipe(
        TINY_RECIPE,
        [
            "model.convert={groups: 1, method: calibrated, calib_data: /c.txt, "
            "refine_steps: 200, refine_lr: 3e-4, refine_qk_lr: 1e-4, refine_target: layer-corrective}"
        ],
    )
    c = r.model.convert
    assert isinstance(c, ConvertOptions)
    assert (c.refine_steps, c.refine_lr, c.refine_qk_lr) == (200, 3e-4, 1e-4)
    assert c.refine_target == "layer-corrective"
    best = load_recipe(TINY_RECIPE, ["model.convert={groups: 1, preset: best}"]).model.convert
    assert best.preset == "best"
    with pytest.raises(RecipeError, match='model.convert.methd: unknown key. Did you mean "method"?'):
        load_recipe(TINY_RECIPE, ["model.convert={groups: 1, methd: mean}"])  # the section's own problem
    with pytest.raises(RecipeError) as e:
        load_recipe(
            TINY_RECIPE,
            ["model.convert={groups: 1, refine_steps: -5, refine_lr: 0, refine_qk_lr: -1, "
             "refine_target: mlp, preset: fastest}"],
        )  # fmt: skip
    msg = str(e.value)
    assert "model.convert.preset 'fastest' is unknown" in msg and "fast" in msg
    assert "model.convert.refine_target 'mlp' is unknown; choose one of attention, layer-corrective" in msg
    assert "model.convert.refine_lr must be a finite learning rate above 0, got 0" in msg
    assert "model.convert.refine_qk_lr must be a finite learning rate above 0, got -1" in msg
    assert "model.convert.refine_steps must be 0 (off) or a positive step count, got -5" in msg
    random = "model.convert.refine_steps cannot start from model.convert.method random"
    with pytest.raises(RecipeError, match=random):
        load_recipe(
            TINY_RECIPE, ["model.convert={groups: 1, method: random, refine_steps: 5, calib_data: /c.txt}"]
        )
