"""End-to-end uptraining of tiny random models on CPU: learning, freezing, distillation, resume,
the saved model, the non-finite guard and bad input. Each test takes a few seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from die_after_step import kill_after
from safetensors.torch import load_file
from tiny_models import save_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from gqakit.errors import GqakitError
from gqakit.uptrain import read_history, train, uptrain


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_loss_falls_and_the_model_saves_as_a_plain_hf_checkpoint(recipe):
    r = recipe("budget.steps=40", "eval.every=20")
    res = uptrain(r)
    hist = read_history(res.output_dir)
    losses = [h["loss"] for h in hist if "loss" in h]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], losses
    assert res.final_val_ppl < res.initial_val_ppl
    assert [h["step"] for h in hist if "val_ppl" in h] == [0, 20, 40]
    assert res.steps == 40 and res.tokens == 40 * 4 * 32 and res.alpha is None

    # Plain transformers loads it, with the converted geometry, its tokenizer and the provenance.
    model = AutoModelForCausalLM.from_pretrained(res.output_dir)
    tok = AutoTokenizer.from_pretrained(res.output_dir)
    assert model.config.num_key_value_heads == 2 and model.config.use_cache
    out = model.generate(**tok("Rivers carry", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > 2
    prov = json.loads((res.output_dir / "gqakit.json").read_text())
    assert prov["command"] == "uptrain" and prov["steps"] == 40 and prov["tokens"] == res.tokens
    assert prov["final_val_ppl"] == pytest.approx(res.final_val_ppl)
    assert prov["convert"]["to_kv_heads"] == 2 and prov["recipe"]["train"]["lr"] == r.train.lr
    assert not (res.output_dir / "checkpoints").exists()  # removed once the final model is saved


@pytest.mark.parametrize("convert", [["model.convert=null"], []], ids=["as-is", "convert-first"])
def test_save_dtype_auto_saves_in_the_sources_dtype(recipe, tmp_path, convert):
    src = save_tiny_model(tmp_path / "bf16", "llama", heads=4, kv_heads=4, dtype=torch.bfloat16)
    res = uptrain(recipe(f"model.path={src}", *convert, "model.save_dtype=auto", "budget.steps=1"))
    assert {t.dtype for t in _weights(res.output_dir).values()} == {torch.bfloat16}
    assert json.loads((res.output_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(res.output_dir, dtype="auto").dtype == torch.bfloat16


def _fail_before_training(r, monkeypatch) -> None:
    """Run ``r`` with a loop that fails before its first step."""

    def boom(*_):
        raise RuntimeError("boom")

    with monkeypatch.context() as m:
        m.setattr(train, "setup", boom)
        with pytest.raises(RuntimeError, match="boom"):
            uptrain(r)


def test_a_run_that_fails_before_its_first_checkpoint_can_simply_be_run_again(recipe, monkeypatch):
    r = recipe("model.convert=null", "budget.steps=2", "eval.at_start=false")
    _fail_before_training(r, monkeypatch)
    assert not Path(r.output_dir).exists()
    assert uptrain(r).steps == 2  # the same command again: no --force needed


def test_a_failed_run_keeps_its_conversion_for_resume(recipe, monkeypatch):
    r = recipe("budget.steps=2", "eval.at_start=false")  # tiny.yaml converts first
    _fail_before_training(r, monkeypatch)
    with pytest.raises(GqakitError, match="--resume"):
        uptrain(r)
    assert uptrain(r, resume=True).steps == 2


def test_convert_first_refines_when_the_recipe_asks(recipe, assets):
    r = recipe(
        "budget.steps=1",
        "eval.at_start=false",
        "model.convert.method=calibrated",
        f"model.convert.calib_data={assets['train']}",
        "model.convert.calib_tokens=512",
        "model.convert.refine_steps=3",
        "model.convert.refine_target=layer-corrective",
    )
    prov = json.loads((uptrain(r).output_dir / "gqakit.json").read_text())
    assert prov["convert"]["method"] == "calibrated" and prov["convert"]["refine"]["steps"] == 3
    assert prov["convert"]["refine"]["target"] == "layer-corrective"


def test_convert_first_takes_a_preset(recipe, assets):
    """``model.convert.preset`` names the conversion as ``gqakit convert --preset`` does; a field given
    beside it overrides the preset's."""
    r = recipe(
        "budget.steps=1", "eval.at_start=false", "model.convert.preset=fast",
        f"model.convert.calib_data={assets['train']}", "model.convert.calib_tokens=512",
        "model.convert.refine_steps=2",
    )  # fmt: skip
    prov = json.loads((uptrain(r).output_dir / "gqakit.json").read_text())
    assert prov["convert"]["method"] == "calibrated" and prov["convert"]["refine"]["steps"] == 2


def test_runs_of_different_precision_in_one_process(recipe, tmp_path):
    # accelerate's state is a process-wide singleton; a second run must not inherit the first's.
    uptrain(recipe("budget.steps=2", "eval.at_start=false", f"output_dir={tmp_path / 'fp32'}"))
    res = uptrain(recipe("budget.steps=2", "train.precision=bf16", f"output_dir={tmp_path / 'bf16'}"))
    assert json.loads((res.output_dir / "gqakit.json").read_text())["precision"] == "bf16"


def test_frozen_parameters_stay_bitwise_equal(recipe):
    trained = (".self_attn.",)
    res = uptrain(recipe("budget.steps=5", "train.trainable=attention", "train.weight_decay=0.5"))
    before, after = _weights(res.output_dir / "work" / "converted"), _weights(res.output_dir)
    assert before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(any(t in k for t in trained) for k in moved), moved
    assert all(torch.equal(before[k], after[k]) for k in before if not any(t in k for t in trained))


def test_distill_kl_is_zero_when_student_is_the_teacher(recipe):
    res = uptrain(
        recipe(
            "model.convert=null",
            "objective.kind=distill",
            "objective.temperature=2.0",
            "budget.steps=3",
            "eval.at_start=false",
        )
    )
    first = next(h for h in read_history(res.output_dir) if "kl" in h)
    assert first["step"] == 1 and first["kl"] == 0.0 and first["loss"] == 0.0
    mixed = uptrain(
        recipe("objective.kind=mix", "budget.steps=2", "output_dir=" + str(res.output_dir) + "-mix")
    )
    assert all({"lm", "kl"} <= h.keys() for h in read_history(mixed.output_dir) if "loss" in h)


def test_resume_reaches_the_same_weights_as_an_uninterrupted_run(recipe, tmp_path, monkeypatch):
    common = ("budget.steps=12", "checkpoint.every=4", "train.grad_accum=2", "eval.every=6")
    full = uptrain(recipe(*common, f"output_dir={tmp_path / 'full'}", model="tied"))

    r = recipe(*common, f"output_dir={tmp_path / 'cut'}", model="tied")
    kill_after(7, lambda: uptrain(r), monkeypatch)
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-00000004"]
    with pytest.raises(GqakitError, match="not empty. Pass --resume"):
        uptrain(r)
    resumed = uptrain(r, resume=True)

    a, b = _weights(full.output_dir), _weights(resumed.output_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.final_val_ppl == full.final_val_ppl
    steps = [h["step"] for h in read_history(resumed.output_dir) if "loss" in h]
    assert steps == list(range(1, 13))  # the killed run's steps 5-7 were replaced, not duplicated
    with pytest.raises(GqakitError, match="finished run"):
        uptrain(r, resume=True)


def test_non_finite_steps_are_skipped_then_rolled_back(recipe, poison_loss):
    poison_loss({3, 8, 9, 10}, float("nan"))  # one lone bad step, then three in a row (micro-batches are
    # never repeated)
    res = uptrain(
        recipe(
            "budget.steps=12", "checkpoint.every=5", "guard.max_bad_steps=3", "guard.lr_factor=0.5",
            "log.every=1",
        )
    )  # fmt: skip
    assert res.skipped_steps == 4 and res.rollbacks == 1 and res.steps == 12
    hist = read_history(res.output_dir)
    events = [h for h in hist if h.get("event") == "rollback"]
    assert events == [{"step": 5, "event": "rollback", "checkpoint": "step-00000005", "lr_scale": 0.5}]
    # steps 6-9 ran twice; the history keeps the second, as after a resume
    assert [h["step"] for h in hist if "loss" in h] == list(range(1, 13))
    assert all(torch.isfinite(t).all() for t in _weights(res.output_dir).values())


def test_rollback_without_a_checkpoint_is_a_clear_error(recipe, monkeypatch):
    loss_step = train.loss_step
    monkeypatch.setattr(train, "loss_step", lambda run, b: (loss_step(run, b)[0] * float("inf"), {}))
    with pytest.raises(GqakitError, match="3 non-finite steps in a row at step 3 and no checkpoint"):
        uptrain(recipe("budget.steps=5"))


def test_bad_data_and_teacher_and_output(recipe, assets, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(GqakitError, match="is empty|holds no"):
        uptrain(recipe(f"data.files=[{empty}]"))
    short = tmp_path / "short.txt"
    short.write_text("Rivers carry sand.\n")
    with pytest.raises(GqakitError, match=r"gives \d+ tokens, fewer than one block of data.seq_len=32"):
        uptrain(recipe(f"data.files=[{short}]", "output_dir=" + str(tmp_path / "o2")))
    other = save_tiny_model(tmp_path / "other", "llama", heads=4, kv_heads=4, vocab_size=512)
    with pytest.raises(GqakitError) as e:
        uptrain(recipe(f"teacher={other}", "objective.kind=distill", f"data.files=[{tmp_path / 'nope.txt'}]"))
    assert "vocabulary of 512 tokens" in str(e.value) and "nope.txt does not exist" in str(e.value)
    with pytest.raises(GqakitError, match="model.convert.groups: --groups 3 does not divide the 4 K/V heads"):
        uptrain(recipe("model.convert.groups=3"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(GqakitError, match="not empty. Pass --resume .* --force"):
        uptrain(recipe(f"output_dir={busy}"))
    assert (busy / "keep.txt").exists()
    with pytest.raises(GqakitError, match="is inside output_dir"):
        uptrain(recipe(f"output_dir={assets['train'].parent}", "model.convert=null"), force=True)
    assert assets["train"].is_file()


def test_eval_at_steps_evaluates_exactly_there_and_matches_validation_perplexity(recipe, assets):
    from gqakit.uptrain import validation_perplexity

    r = recipe("budget.steps=6", "eval.every=0", "eval.at_steps=[2, 3, 9]", "model.convert=null")
    res = uptrain(r)
    evals = [h for h in read_history(res.output_dir) if "val_ppl" in h]
    assert [h["step"] for h in evals] == [0, 2, 3, 6]  # 9 is past the budget; 6 is the final evaluation
    # the reference measurement reads the same blocks the same way as the run's own evaluations
    ppl, blocks = validation_perplexity(r, str(assets["mha"]))
    assert ppl == pytest.approx(evals[0]["val_ppl"], rel=1e-6) and blocks > 0
    ppl, _ = validation_perplexity(r, str(res.output_dir))
    assert ppl == pytest.approx(evals[-1]["val_ppl"], rel=1e-6)


def test_eval_at_steps_must_be_positive(recipe):
    from gqakit.uptrain import RecipeError

    with pytest.raises(RecipeError, match=r"eval.at_steps must be steps of at least 1, got \[0, 4\]"):
        recipe("eval.at_steps=[0, 4]")


def test_a_start_made_by_an_earlier_run_does_not_replace_this_runs_records(recipe, tmp_path):
    """A checkpoint written by an earlier run holds that run's metrics.jsonl and recipe.yaml: uptraining
    from it (or converting it) must keep the new run's own records, not copy the old ones over them."""
    first = uptrain(recipe("budget.steps=3", f"output_dir={tmp_path / 'first'}"))
    assert (first.output_dir / "metrics.jsonl").is_file() and (first.output_dir / "recipe.yaml").is_file()
    second = uptrain(
        recipe(
            "budget.steps=5", "eval.every=0", "model.convert=null", f"model.path={first.output_dir}",
            f"output_dir={tmp_path / 'second'}",
        )
    )  # fmt: skip
    steps = [h["step"] for h in read_history(second.output_dir) if "loss" in h]
    assert steps == [1, 2, 3, 4, 5]
    assert str(tmp_path / "second") in (second.output_dir / "recipe.yaml").read_text()
