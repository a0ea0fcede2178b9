"""The pure regrouping functions, checked by hand and against transformers' own attention."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from gqakit.convert import ADAPTERS, RegroupSpec, convert_state_dict
from gqakit.convert.plan import regroup, regroup_head_axis
from gqakit.geometry import AttentionGeometry


def test_hand_checked_four_heads_into_two_groups():
    # H = 4 K/V heads of head_dim 2, hidden 1: head h has rows [10h + 1, 10h + 2].
    w = torch.tensor([[1.0], [2.0], [11.0], [12.0], [21.0], [22.0], [31.0], [32.0]])
    pooled = regroup_head_axis(w, num_kv_heads=4, target=2, head_dim=2, method="mean")
    # group 0 = heads 0, 1 -> mean(1, 11) = 6, mean(2, 12) = 7; group 1 = heads 2, 3 -> 26, 27
    assert pooled.tolist() == [[6.0], [7.0], [26.0], [27.0]]
    first = regroup_head_axis(w, num_kv_heads=4, target=2, head_dim=2, method="first")
    assert first.tolist() == [[1.0], [2.0], [21.0], [22.0]]
    bias = torch.tensor([1.0, 2.0, 11.0, 12.0, 21.0, 22.0, 31.0, 32.0])
    assert regroup_head_axis(bias, 4, 2, 2).tolist() == [6.0, 7.0, 26.0, 27.0]


def test_expand_repeats_each_head_over_its_group():
    w = torch.arange(4.0).reshape(2, 2, 1)  # 2 heads, head_dim 2
    assert regroup(w, 4).reshape(-1).tolist() == [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]


def test_pooling_in_float32_then_cast_back():
    w = torch.tensor([[1.0], [1.0 + 2**-7]], dtype=torch.bfloat16).reshape(2, 1, 1)
    out = regroup(w, 1)
    assert out.dtype == torch.bfloat16
    # The bf16 sum would round; float32 gives the exact midpoint, then one rounding.
    assert out.item() == torch.tensor(1.0 + 2**-8).to(torch.bfloat16).item()


def test_random_method_is_seeded_and_uses_init_std():
    w = torch.zeros(8, 16, 64)
    a = regroup(w, 2, "random", std=0.5, generator=torch.Generator().manual_seed(3))
    b = regroup(w, 2, "random", std=0.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert 0.45 < a.std().item() < 0.55
    assert regroup(w, 2, "random", init="zeros").abs().sum() == 0
    assert torch.all(regroup(w, 2, "random", init="ones") == 1)


def test_fused_qkv_pools_only_k_and_v_rows():
    heads, kv, d = 4, 4, 2
    t = torch.arange(float((heads + 2 * kv) * d)).reshape(-1, 1)
    phi3, geom = ADAPTERS["phi3"], AttentionGeometry("phi3", 1, 1, heads, kv, d)
    name = phi3.tensor("qkv", 0)
    out = convert_state_dict({name: t}, phi3, geom, RegroupSpec(2))[name]
    assert out.shape == ((heads + 2 * 2) * d, 1)
    assert torch.equal(out[: heads * d], t[: heads * d])
    k = t[heads * d : (heads + kv) * d]
    assert torch.equal(out[heads * d : (heads + 2) * d], regroup_head_axis(k, kv, 2, d))


@pytest.mark.parametrize("bad", [(4, 3), (4, 0)])
def test_regroup_rejects_groups_that_do_not_divide(bad):
    k, target = bad
    with pytest.raises(ValueError):
        regroup(torch.zeros(k, 2), target)


def test_pooling_commutes_with_rotary():
    """Rotating the mean of K heads equals the mean of the rotated heads, at every position."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    model = tiny_model("llama", heads=4, kv_heads=4)
    rope = LlamaRotaryEmbedding(model.config)
    x = torch.randn(1, 32, model.config.hidden_size)
    w = model.model.layers[0].self_attn.k_proj.weight
    d = model.config.head_dim
    pos = torch.arange(32)[None]
    cos, sin = rope(x, pos)
    k_heads = (x @ w.T).view(1, 32, 4, d).transpose(1, 2)  # [b, heads, t, d]
    rotated = apply_rotary_pos_emb(k_heads, k_heads, cos, sin)[0]
    pooled_w = regroup_head_axis(w.detach(), 4, 2, d)
    k_pooled = (x @ pooled_w.T).view(1, 32, 2, d).transpose(1, 2)
    rot_of_mean = apply_rotary_pos_emb(k_pooled, k_pooled, cos, sin)[0]
    mean_of_rot = rotated.reshape(1, 2, 2, 32, d).mean(2)
    torch.testing.assert_close(rot_of_mean, mean_of_rot, rtol=1e-5, atol=1e-6)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _regrouped_model(model, groups: int):
    from transformers import AutoModelForCausalLM

    geom = AttentionGeometry.from_config(model.config.to_dict())
    sd = convert_state_dict(model.state_dict(), ADAPTERS[model.config.model_type], geom, RegroupSpec(groups))
    cfg = model.config.__class__(**{**model.config.to_dict(), "num_key_value_heads": groups})
    out = AutoModelForCausalLM.from_config(cfg).eval()
    out.load_state_dict(sd)
    return out


def test_groups_equal_heads_gives_identical_logits():
    model = tiny_model("llama", heads=4, kv_heads=4)
    ids = torch.randint(3, 300, (2, 16))
    torch.testing.assert_close(_logits(_regrouped_model(model, 4), ids), _logits(model, ids), rtol=0, atol=0)


def test_identical_heads_within_groups_give_identical_logits():
    """If the K/V heads inside each group are already equal, pooling them loses nothing."""
    model = tiny_model("llama", heads=4, kv_heads=4)
    d = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                heads = proj.weight.view(4, d, -1)
                heads[1].copy_(heads[0])
                heads[3].copy_(heads[2])
    ids = torch.randint(3, 300, (2, 16))
    pooled = _regrouped_model(model, 2)
    assert pooled.config.num_key_value_heads == 2
    torch.testing.assert_close(_logits(pooled, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    # ...whereas distinct heads do change the output: the test above is not vacuous.
    other = tiny_model("llama", heads=4, kv_heads=4, seed=1)
    assert not torch.allclose(_logits(_regrouped_model(other, 2), ids), _logits(other, ids), atol=1e-3)
