"""Head grouping: a whole-head permutation changes no output; similarity grouping finds shuffled groups."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch
from tiny_models import TINY_TEXT, save_tiny_model, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM

from gqakit.convert import ConvertOptions, convert_checkpoint, expand_checkpoint, get_adapter
from gqakit.convert.grouping import (
    contiguous_groups,
    permute_cols,
    permute_rows,
    query_order,
    similarity_groups,
)
from gqakit.family_parts import ArchAdapter, Role
from gqakit.geometry import AttentionGeometry

IDS = torch.randint(3, 300, (2, 32), generator=torch.Generator().manual_seed(0))


def permute_heads_state_dict(
    state_dict: dict[str, torch.Tensor],
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    kv_orders: Sequence[Sequence[int]],
) -> dict[str, torch.Tensor]:
    """Reorder the K/V heads of every layer (``kv_orders[layer]``), moving their query heads along.

    Touches q/k/v rows and biases (or the fused q|k|v rows), o_proj columns, per-head norms and flat
    per-channel norms. The result computes exactly the same function.
    """
    sd = dict(state_dict)
    d, kv, n_rep = geom.head_dim, geom.num_kv_heads, geom.queries_per_kv
    for layer, kv_order in enumerate(kv_orders):
        q_order = query_order(kv_order, n_rep)

        def names(role: Role, layer: int = layer) -> list[str]:
            m = adapter.module(role, layer)
            return [] if m is None else [f"{m}.{s}" for s in ("weight", "bias") if f"{m}.{s}" in sd]

        for n in names("q") + names("q_norm_flat"):
            sd[n] = permute_rows(sd[n], q_order, d)
        for n in names("k") + names("v") + names("k_norm_flat"):
            sd[n] = permute_rows(sd[n], kv_order, d)
        for n in names("qkv"):
            q, k, v = sd[n].split([geom.num_heads * d, kv * d, kv * d])
            sd[n] = torch.cat(
                [permute_rows(q, q_order, d), permute_rows(k, kv_order, d), permute_rows(v, kv_order, d)]
            )
        o = adapter.tensor("o", layer)
        sd[o] = permute_cols(sd[o], q_order, d)
        for template, order in ((adapter.q_norm_per_head, q_order), (adapter.k_norm_per_head, kv_order)):
            if template is None:
                continue
            for suffix in ("weight", "bias"):
                old = [f"{template.format(layer=layer, head=h)}.{suffix}" for h in range(len(order))]
                if all(n in sd for n in old):
                    moved = [sd[old[h]].clone() for h in order]
                    for n, t in zip(old, moved, strict=True):
                        sd[n] = t
    return sd


def _logits(model_or_path):
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model_or_path).eval()
    with torch.no_grad():
        return model(IDS).logits


def _shuffle(model, seed: int):
    """Permute every layer's K/V heads (with their query heads) at random; return the orders used."""
    geom = AttentionGeometry.from_config(model.config.to_dict())
    gen = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(geom.num_kv_heads, generator=gen).tolist() for _ in range(geom.num_layers)]
    orders[0] = orders[0][::-1] if orders[0] == sorted(orders[0]) else orders[0]  # never all identities
    sd = permute_heads_state_dict(model.state_dict(), get_adapter(geom.model_type), geom, orders)
    model.load_state_dict(sd)
    return orders


@pytest.mark.parametrize(
    "family, kw",
    [
        ("llama", {"heads": 8, "kv_heads": 4}),  # GQA: each K/V head carries 2 query heads
        ("qwen2", {"heads": 4, "kv_heads": 4}),  # q/k/v biases
        ("stablelm", {"heads": 4, "kv_heads": 4, "qk_layernorm": True}),  # per-head q and k norms
        ("olmo2", {"heads": 4, "kv_heads": 2}),  # flat q/k norms over all heads' channels
        ("phi3", {"heads": 4, "kv_heads": 2}),  # fused q|k|v
        ("gemma3_text", {"heads": 4, "kv_heads": 4, "head_dim": 16}),  # shared q/k norms
    ],
)
def test_a_head_permutation_changes_no_output(family, kw):
    model = tiny_model(family, **kw)
    before = _logits(model)
    orders = _shuffle(model, seed=3)
    assert any(o != sorted(o) for o in orders)
    torch.testing.assert_close(_logits(model), before, rtol=1e-5, atol=1e-5)


def test_query_order_moves_each_kv_heads_queries():
    assert query_order([2, 0, 1], 2) == [4, 5, 0, 1, 2, 3]


def test_similarity_groups_recovers_hidden_partition():
    truth = [[0, 5], [1, 3], [2, 7], [4, 6]]
    label = {h: g for g, grp in enumerate(truth) for h in grp}

    def cost(heads):
        return float(len({label[h] for h in heads}) - 1) + 0.01 * sum(heads)

    assert similarity_groups(cost, 8, 4) == truth
    truth4 = [[0, 2, 5, 7], [1, 3, 4, 6]]
    label = {h: g for g, grp in enumerate(truth4) for h in grp}
    assert similarity_groups(cost, 8, 2) == truth4
    assert similarity_groups(cost, 8, 1) == contiguous_groups(8, 1) == [list(range(8))]
    assert similarity_groups(cost, 8, 8) == [[h] for h in range(8)]


@pytest.fixture(scope="module")
def calib_txt(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TINY_TEXT * 12)
    return path


@pytest.mark.parametrize(
    "family, method, kw",
    [
        ("llama", "calibrated", {}),
        ("llama", "mean", {}),
        ("qwen2", "calibrated", {}),  # biases
        ("phi3", "calibrated", {}),  # fused q|k|v
        ("olmo2", "calibrated", {}),  # flat q/k norms; keys fall back to mean
        ("stablelm", "calibrated", {"qk_layernorm": True}),  # per-head q/k norms; keys fall back to mean
    ],
)
def test_similarity_regroups_a_shuffled_expanded_model_exactly(tmp_path, calib_txt, family, method, kw):
    """GQA-2 -> expand to 8 K/V heads -> shuffle -> back to 2 groups: exact with similarity only."""
    src = save_tiny_model(tmp_path / "gqa", family, heads=8, kv_heads=2, **kw)
    expand_checkpoint(src, tmp_path / "mha")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mha").eval()
    _shuffle(model, seed=0)
    model.save_pretrained(tmp_path / "shuffled")
    tiny_tokenizer(model.config.vocab_size).save_pretrained(tmp_path / "shuffled")
    ref = _logits(src)
    torch.testing.assert_close(_logits(tmp_path / "shuffled"), ref, rtol=1e-5, atol=1e-5)

    opts = dict(groups=2, method=method, calib_data=str(calib_txt), calib_tokens=256)
    res = convert_checkpoint(
        tmp_path / "shuffled", tmp_path / "sim", ConvertOptions(grouping="similarity", **opts)
    )
    torch.testing.assert_close(_logits(tmp_path / "sim"), ref, rtol=1e-4, atol=1e-4)
    prov = json.loads((tmp_path / "sim" / "gqakit.json").read_text())
    assert prov["grouping"] == "similarity"
    assert all(
        len(e["groups"]) == 2 and e["key"] < 1e-9 and e["value"] < 1e-9 for e in prov["reconstruction_error"]
    )
    assert res.to_kv_heads == 2

    kw = opts if method == "calibrated" else {"groups": 2}
    convert_checkpoint(tmp_path / "shuffled", tmp_path / "cont", ConvertOptions(**kw))
    assert not torch.allclose(_logits(tmp_path / "cont"), ref, rtol=1e-3, atol=1e-3)


def test_similarity_with_first_and_random(tmp_path, calib_txt):
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4)
    opts = dict(groups=2, grouping="similarity", calib_data=str(calib_txt), calib_tokens=256)
    convert_checkpoint(src, tmp_path / "first", ConvertOptions(method="first", **opts))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "first").config.num_key_value_heads == 2
    from gqakit.errors import GqakitError

    with pytest.raises(GqakitError, match="cannot be combined with --method random"):
        convert_checkpoint(src, tmp_path / "rnd", ConvertOptions(method="random", **opts))
