"""Objectives on hand-made logits: cross-entropy, KL at a temperature, the mix."""

from __future__ import annotations

import math

import pytest
import torch

from gqakit.uptrain.objectives import Objective, distill_kl, lm_loss_per_sequence


def test_kl_is_exactly_zero_for_equal_logits_and_positive_otherwise():
    x = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    for t in (0.5, 1.0, 4.0):
        assert distill_kl(x, x.clone(), t).item() == 0.0
    assert distill_kl(x, x + torch.randn_like(x), 2.0).item() > 0


def test_kl_matches_the_formula_with_temperature_squared():
    s, t = torch.tensor([[[0.0, 1.0]]]), torch.tensor([[[1.0, 0.0]]])
    p, q = torch.softmax(t / 2, -1), torch.softmax(s / 2, -1)
    want = (p * (p.log() - q.log())).sum() * 4
    assert distill_kl(s, t, 2.0).item() == pytest.approx(want.item(), rel=1e-6)


def test_lm_loss_is_next_token_cross_entropy():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 100.0  # position 0 confidently predicts token 2
    ids = torch.tensor([[0, 2, 1]])
    # position 0 -> 2 (right, ~0 loss), position 1 -> 1 (uniform, log 4)
    assert lm_loss_per_sequence(logits, ids).mean().item() == pytest.approx(math.log(4) / 2, rel=1e-5)
    assert lm_loss_per_sequence(logits, ids).shape == (1,)


def test_mix_weights_its_parts():
    s, t = torch.randn(2, 4, 7), torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    loss, parts = Objective("mix", temperature=2.0, distill_weight=0.25)(s, ids, t)
    assert loss.item() == pytest.approx(0.75 * parts["lm"].item() + 0.25 * parts["kl"].item(), rel=1e-6)
    assert set(Objective("lm")(s, ids)[1]) == {"lm"}
    with pytest.raises(ValueError, match="teacher"):
        Objective("distill")(s, ids)
