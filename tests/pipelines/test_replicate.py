"""``gqakit replicate`` on a toy corpus and a tiny model: the whole pipeline, alpha accounting, the cache
(a changed setting reruns only what depends on it) and the report's figures."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import TINY_TEXT

from gqakit.cli import main
from gqakit.cli_options import parse_list
from gqakit.errors import GqakitError
from gqakit.pipelines.replicate import run_replicate
from gqakit.pipelines.replicate.options import ModelShape, ReplicateOptions
from gqakit.pipelines.replicate.report import _markdown, findings
from gqakit.pipelines.replicate.run import Arm, _arm_plan
from gqakit.problems import check_options
from gqakit.storage import working_directory

TINY = ModelShape(vocab=300, layers=2, hidden=32, heads=4, intermediate=64, seq_len=32)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("corpus")
    sentences = [s.strip() + "." for s in TINY_TEXT.split(".") if s.strip()]
    rng = random.Random(0)
    files = []
    for name, lines in (("train", 300), ("validation", 20), ("test", 30)):
        files.append(root / f"{name}.txt")
        files[-1].write_text("\n".join(" ".join(rng.sample(sentences, 4)) for _ in range(lines)) + "\n")
    return tuple(files)  # type: ignore[return-value]


def tiny(tmp_path: Path, corpus, messages: list[str], **kw) -> ReplicateOptions:
    base = dict(
        out=tmp_path / "report",
        work_dir=tmp_path / "work",
        device="cpu",
        seeds=(0, 1),
        alphas=(0.0, 0.5),
        groups=(1, 2),
        starts=("mean", "first", "random", "fast"),
        shape=TINY,
        pretrain_steps=8,
        batch_size=4,
        sets=("model.convert.calib_tokens=256", "model.convert.refine_steps=4"),
        corpus=corpus,
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=messages.append,
    )
    return ReplicateOptions(**{**base, **kw})


def test_the_pipeline_end_to_end_then_reused(tmp_path, corpus):
    messages: list[str] = []
    res = run_replicate(tiny(tmp_path, corpus, messages))
    kinds = {a.kind for a in res.arms}
    assert kinds == {"mha", "converted", "mha-continued", "scratch"}
    # alpha accounting: pretraining 8 steps x 4 blocks x 32 tokens; alpha 0.5 uptrains half of that
    assert res.pretrain_tokens == 8 * 4 * 32
    up = next(a for a in res.arms if a.name == "g1-mean-a0.5-s0")
    assert up.uptrain["tokens"] == 512 and up.uptrain["alpha"] == pytest.approx(0.5)
    scratch = next(a for a in res.arms if a.name == "scratch-g1")
    assert scratch.uptrain["tokens"] == 1024 + 512  # the same total budget as pretraining + uptraining
    assert {a.groups for a in res.arms if a.kind == "scratch"} == {1, 2, TINY.heads}  # MQA, GQA, MHA
    assert all(a.ppl and a.ppl > 1 for a in res.arms)
    results = json.loads(res.results_json.read_text())
    assert set(results["findings"]) >= {"fig4", "fig5", "fig6", "scratch"}
    text = res.report.read_text()
    for heading in (
        "## Fig. 4",
        "## Fig. 5",
        "## Fig. 6 / Table 1",
        "## Uptrained against trained from scratch",
    ):
        assert heading in text
    assert "MHA-XXL | 1.51 | 47.2" in text  # the paper's own numbers, beside ours
    for fig in res.figures:
        assert fig.is_file() and fig.stat().st_size > 5000

    # the pretrained MHA model is an asset now
    listing = CliRunner().invoke(main, ["assets", "list", "--cache-dir", str(tmp_path / "cache")])
    assert "replicate-mha" in listing.output and str(tmp_path / "cache" / "replicate-mha") in listing.output
    from gqakit.assets import fetch_asset

    model = fetch_asset("replicate-mha", tmp_path / "cache")["model"]
    assert json.loads((model / "config.json").read_text())["num_key_value_heads"] == TINY.heads

    again: list[str] = []
    res2 = run_replicate(tiny(tmp_path, corpus, again))
    assert [a.ppl for a in res2.arms] == [a.ppl for a in res.arms]
    assert not any("steps," in m and "tokens, validation" in m for m in again)  # no training ran
    # a fresh run reuses nothing; the cached re-run reports, beside its own seconds, the time the
    # figures took to compute: the results' own recorded times, the same sum as the first run's
    took = re.search(r"Took (.+?) \((\d+) results reused", text)
    took2 = re.search(r"Took (.+?) \((\d+) results reused", res2.report.read_text())
    assert took and took2 and took.group(2) == "0" and int(took2.group(2)) > 0
    first, second = (json.loads(r.results_json.read_text()) for r in (res, res2))
    assert second["compute_s"] == first["compute_s"] > second["elapsed_s"]
    assert "; the runs that computed these figures took " in res2.report.read_text()


def test_a_changed_setting_reruns_only_what_depends_on_it(tmp_path, corpus):
    run_replicate(tiny(tmp_path, corpus, []))
    messages: list[str] = []
    run_replicate(tiny(tmp_path, corpus, messages, alphas=(0.0, 0.25, 0.5)))
    trained = [m.split(":")[0].strip() for m in messages if "tokens, validation" in m]
    # only the new alpha's arms train: one per method at seed 0, the paper's methods' second seed moved
    # to the new middle alpha; pretraining, the other arms and the scratch models are reused
    assert sorted(trained) == sorted(
        ["g1-mean-a0.25-s0", "g1-first-a0.25-s0", "g1-random-a0.25-s0", "g1-fast-a0.25-s0",
         "g1-mean-a0.25-s1", "g1-first-a0.25-s1", "g1-random-a0.25-s1"]
    )  # fmt: skip


def test_pretrain_only_builds_and_publishes_the_mha_model(tmp_path, corpus):
    from gqakit.pipelines.replicate import pretrain_mha

    messages: list[str] = []
    mha = pretrain_mha(tiny(tmp_path, corpus, messages))
    config = json.loads((mha / "config.json").read_text())
    assert config["num_key_value_heads"] == config["num_attention_heads"] == TINY.heads
    assert (tmp_path / "cache" / "replicate-mha" / "model" / "config.json").is_file()
    assert any(m.startswith("[3/3]") for m in messages) and not any(m.startswith("[4/") for m in messages)


def test_the_arm_plan_covers_the_papers_figures():
    o = ReplicateOptions(seeds=(0, 1), alphas=(0.0, 0.05, 0.1), groups=(1, 2, 4))
    names = {a.name for a in _arm_plan(o)}
    assert {"g1-mean-a0", "g1-first-a0", "g1-random-a0", "g1-calibrated-a0", "g1-fast-a0"} <= names
    assert {"g1-mean-a0.05-s0", "g1-mean-a0.05-s1", "g1-random-a0.05-s1"} <= names  # seeds: headline
    assert "g1-calibrated-a0.05-s1" not in names  # a second seed only for the paper's methods
    assert {"g2-mean-a0.1-s0", "g4-mean-a0.1-s0", "g4-mean-a0"} <= names
    assert o.uptrain_steps(0.05) == round(0.05 * o.steps)


def test_bad_options_are_reported_together(tmp_path, corpus):
    with pytest.raises(GqakitError) as e:
        run_replicate(
            tiny(
                tmp_path,
                corpus,
                [],
                scale=0,
                groups=(3, 4),
                alphas=(0.5, 0.1),
                starts=("median",),
            )
        )
    for fragment in (
        "--scale must be positive",
        "groups 3,4",
        "--alphas must be increasing, >= 0 and finite, got 0.5,0.1",
        "--starts median",
    ):
        assert fragment in e.value.message


def test_scale_widens_and_deepens_the_model():
    big = replace(ReplicateOptions(), scale=4.0)
    assert big.model.hidden == 1024 and big.model.layers == 8 and big.model.heads == 8
    assert big.steps == 4 * ReplicateOptions().steps


def test_a_working_directory_another_run_holds_is_refused(tmp_path, corpus):
    from gqakit.pipelines.replicate import pretrain_mha

    messages: list[str] = []
    with working_directory(tmp_path / "work"):
        for run in (run_replicate, pretrain_mha):
            with pytest.raises(GqakitError, match=r"--work-dir .*work is in use by another run \(pid"):
                run(tiny(tmp_path, corpus, messages))
    assert messages == [] and not (tmp_path / "work" / "results").exists()


def test_cli_help_and_bad_lists():
    res = CliRunner().invoke(main, ["replicate", "--help"])
    assert res.exit_code == 0 and "--scale" in res.output and "--alphas" in res.output
    res = CliRunner().invoke(main, ["replicate", "--alphas", "a,b"])
    assert res.exit_code != 0 and "comma-separated numbers" in res.output


# ---------------------------------------------------------------------------------------------------
# The report step on the arms each valid set of options makes (no training: made-up perplexities)
# ---------------------------------------------------------------------------------------------------


def _measured_arms(o: ReplicateOptions) -> list[Arm]:
    """The arms a run with ``o`` reports, as run._replicate makes them, with made-up perplexities."""
    arms = [Arm("mha", "mha", o.model.heads, ppl=10.0)]
    for i, a in enumerate(_arm_plan(o)):
        a.ppl = 20.0 + i
        arms.append(a)
    arms.append(Arm("mha-cont", "mha-continued", o.model.heads, alpha=max(o.alphas), ppl=9.0))
    arms += [Arm(f"scratch-g{g}", "scratch", g, ppl=30.0) for g in dict.fromkeys((1, max(o.groups), 8))]
    return arms


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"seeds": (1, 2)},  # the alpha-0 arms are made with seed 0 whatever the seeds
        {"seeds": (3,), "alphas": (0.0, 0.05)},
        {"starts": ("calibrated", "fast")},
        {"starts": ("mean",)},
        {"alphas": (0.0,)},
    ],
)
def test_the_report_step_takes_the_arms_of_every_valid_option_set(kw):
    o = ReplicateOptions(**kw)
    check_options(o, "replicate")
    arms = _measured_arms(o)
    f = findings(o, arms, {})
    at0 = {a.method: a.ppl for a in arms if a.kind == "converted" and a.groups == 1 and a.alpha == 0}
    assert {m: c[0.0] for m, c in f["fig5"]["curves"].items()} == {m: at0[m] for m in o.starts}
    assert "# gqakit replicate" in _markdown(o, f, "1 s", [])


def test_alphas_must_start_at_0_where_the_report_compares_everything():
    with pytest.raises(GqakitError) as e:
        check_options(ReplicateOptions(alphas=(0.025, 0.05, 0.1)), "replicate")
    assert "--alphas must start at 0, got 0.025,0.05,0.1" in e.value.message
    assert "e.g. 0,0.025,0.05,0.1" in e.value.message


@pytest.mark.parametrize("starts", [("calibrated", "fast"), ("mean",), ("fast", "random")])
def test_the_fig4_order_of_fewer_than_two_paper_methods_is_not_measured(starts):
    o = ReplicateOptions(starts=starts)
    f = findings(o, _measured_arms(o), {})
    assert f["fig4"]["ordered_at_0"] is None and f["fig4"]["ordered_after"] is None
    line = next(x for x in _markdown(o, f, "1 s", []).splitlines() if x.startswith("mean < first"))
    assert "reproduced" not in line and line.count("not measured") == 2 and "--starts" in line


@pytest.mark.parametrize("random_ppl, ordered", [(50.0, True), (5.0, False)])
def test_the_fig4_order_of_two_paper_methods_is_measured(random_ppl, ordered):
    o = ReplicateOptions(starts=("random", "mean"))
    arms = _measured_arms(o)
    for a in arms:
        if a.method == "random":
            a.ppl = random_ppl
    f = findings(o, arms, {})
    assert f["fig4"]["ordered_at_0"] is ordered and f["fig4"]["ordered_after"] is ordered


def test_no_methods_are_refused():
    with pytest.raises(GqakitError, match="--starts needs at least one start"):
        check_options(ReplicateOptions(starts=parse_list(",", str, "--starts")), "replicate")


def test_non_finite_alphas_are_refused_before_any_step():
    res = CliRunner().invoke(main, ["replicate", "--alphas", "0,0.05,inf"])
    assert res.exit_code == 2 and "inf is not a finite number" in res.output
    with pytest.raises(GqakitError, match=r"--alphas must be increasing, >= 0 and finite, got 0.0,0.05,inf"):
        check_options(
            ReplicateOptions(alphas=(0.0, 0.05, float("inf"))), "replicate"
        )  # from Python, parse_list is bypassed


def test_an_alpha_that_gives_no_uptraining_step_is_refused_with_the_smallest_that_does():
    with pytest.raises(GqakitError) as e:
        check_options(ReplicateOptions(alphas=(0.0, 0.0001, 0.05)), "replicate")
    assert "--alphas 0.0001 gives 0 uptraining steps of the 500 pretraining steps" in e.value.message
    assert "the smallest alpha that gives one step is 1/500 = 0.002" in e.value.message
    check_options(ReplicateOptions(alphas=(0.0, 0.002, 0.05)), "replicate")
    assert ReplicateOptions().uptrain_steps(0.002) == 1
