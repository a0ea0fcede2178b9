"""The speed levers: the fused output projection + loss equals the unfused objectives (values and
gradients), levers a CPU cannot run are turned off with the reason, and a run's losses do not depend on
them beyond rounding."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import tiny_model

from gqakit.uptrain import read_history, uptrain
from gqakit.uptrain.objectives import Objective, fused_linear_loss, install_fused_loss
from gqakit.uptrain.setup import decoder_layers, resolve_speed


@pytest.mark.parametrize("kind", ["lm", "distill", "mix"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [50, 7 * 50, 10**6])  # one token, several, all at once
def test_fused_loss_equals_the_objective_and_its_gradients(kind, bias, chunk):
    g = torch.Generator().manual_seed(0)
    b, s, h, v = 2, 5, 8, 50
    hidden = torch.randn(b, s, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias_t = torch.randn(v, generator=g, requires_grad=True) if bias else None
    t_hidden, t_weight = torch.randn(b, s, h, generator=g), torch.randn(v, h, generator=g)
    ids = torch.randint(0, v, (b, s), generator=g)
    params = [hidden, weight] + ([bias_t] if bias else [])

    logits = hidden @ weight.t() + (bias_t if bias else 0)
    want, want_parts = Objective(kind, 2.0, 0.3)(logits, ids, t_hidden @ t_weight.t())
    want_grads = torch.autograd.grad(want, params)
    spec = Objective(kind, 2.0, 0.3, chunk_elements=chunk)
    got, parts = fused_linear_loss(hidden, weight, bias_t, ids, spec, t_hidden, t_weight)
    got_grads = torch.autograd.grad(got, params)

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert parts.keys() == want_parts.keys()
    for k in parts:
        torch.testing.assert_close(parts[k], want_parts[k], rtol=1e-5, atol=1e-6)
    for a, e in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def test_fused_forward_of_a_model_with_tied_embeddings_matches_its_own_loss():
    model = tiny_model("llama", tie_word_embeddings=True).train()
    ids = torch.randint(3, 384, (2, 16), generator=torch.Generator().manual_seed(1))
    want, _ = Objective("lm")(model(input_ids=ids).logits, ids)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    install_fused_loss(model)
    got, parts = model(input_ids=ids, loss_spec=Objective("lm"))
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, e in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
    # Called without loss_spec, the forward is the model's own (evaluation reads logits).
    assert model(input_ids=ids).logits.shape == (2, 16, 384)


def test_fused_loss_under_bf16_autocast_stays_within_bf16_rounding():
    model = tiny_model("llama").train()
    ids = torch.randint(3, 384, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = Objective("lm")(model(input_ids=ids).logits, ids)
        install_fused_loss(model)
        got, _ = model(input_ids=ids, loss_spec=Objective("lm", compute_dtype=torch.bfloat16))
    assert abs(got.item() - want.item()) < 1e-2 * want.item()


def _speed(**kw):
    from gqakit.uptrain.recipe_schema import SpeedConfig

    return SpeedConfig(**kw)


def test_auto_on_a_cpu_keeps_the_fused_loss_and_says_what_is_off():
    s, said = resolve_speed(_speed(), "cpu", "NO", tiny_model("llama"))
    assert (s.fused_loss, s.compile) == (True, False)
    assert said.startswith("speed: fused loss; off: compile (auto: on for CUDA")
    on_gpu, _ = resolve_speed(_speed(), "cuda", "NO", tiny_model("llama"))
    assert on_gpu.fused_loss is True and on_gpu.compile is True
    eager_gpu, _ = resolve_speed(_speed(compile=False), "cuda", "NO", tiny_model("llama"))
    assert not eager_gpu.fused_loss and not eager_gpu.compile  # measured slower eager on a GPU
    fsdp, said = resolve_speed(_speed(), "cuda", "FSDP", tiny_model("llama"))
    assert not fsdp.fused_loss and not fsdp.compile and "not measured under FSDP" in said


def test_a_model_that_transforms_its_logits_keeps_the_plain_loss():
    model = tiny_model("gemma2")
    assert model.config.final_logit_softcapping
    s, said = resolve_speed(_speed(fused_loss=True), "cpu", "NO", model)
    assert not s.fused_loss and "final_logit_softcapping" in said


def test_decoder_layers_are_the_repeated_blocks():
    model = tiny_model("llama", layers=3)
    assert [type(m).__name__ for m in decoder_layers(model)] == ["LlamaDecoderLayer"] * 3


@pytest.mark.parametrize("objective", ["lm", "distill"])
def test_a_run_trains_the_same_with_and_without_the_fused_loss(recipe, tmp_path, objective, caplog):
    common = ("budget.steps=6", f"objective.kind={objective}", "model.convert.groups=2")
    with caplog.at_level(logging.INFO, logger="gqakit.uptrain"):
        fused = uptrain(recipe(*common, "speed.fused_loss=true", f"output_dir={tmp_path / 'f'}"))
    assert "speed: fused loss; off: compile" in caplog.text
    plain = uptrain(recipe(*common, "speed.fused_loss=false", f"output_dir={tmp_path / 'p'}"))
    a = [h["loss"] for h in read_history(fused.output_dir) if "loss" in h]
    b = [h["loss"] for h in read_history(plain.output_dir) if "loss" in h]
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    if objective == "lm":  # (the tiny model's KL to its own mean-pooled conversion starts near 0)
        assert a[-1] < a[0]
    assert abs(fused.final_val_ppl - plain.final_val_ppl) < 1e-3 * plain.final_val_ppl
