"""Calibrated conversion: exact on models built to be mergeable, where mean pooling is not; bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from tiny_models import TINY_TEXT, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM

from gqakit.cli import main
from gqakit.convert import ADAPTERS, ConvertOptions, convert_checkpoint
from gqakit.convert.merge import (
    augment,
    compensate_o_cols,
    compensate_q_rows,
    fit_key_merge,
    fit_value_merge,
    in_metric,
    merge_error,
    merge_rows,
)
from gqakit.errors import GqakitError

IDS = torch.randint(3, 300, (2, 64), generator=torch.Generator().manual_seed(0))  # 64-token sequences
D = 16  # head_dim of the tiny models (hidden 64, 4 heads)


@pytest.fixture(scope="module")
def calib_txt(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TINY_TEXT * 12)
    return path


def _save(model, path):
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def _logits(path_or_model):
    model = path_or_model
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(path_or_model).eval()
    with torch.no_grad():
        return model(IDS).logits


def _set_heads(proj: torch.nn.Linear, heads: list[torch.Tensor]) -> None:
    """Write ``[d, hidden + 1]`` augmented rows (weight | bias) of every head into ``proj``."""
    rows = torch.cat(heads)
    proj.weight.copy_(rows[:, :-1])
    if proj.bias is not None:
        proj.bias.copy_(rows[:, -1])


def _heads(proj: torch.nn.Linear, kv: int) -> list[torch.Tensor]:
    return list(augment(proj.weight, proj.bias).float().reshape(kv, D, -1))


def _linear_maps_of_head0(h0: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Head 0 and ``n - 1`` invertible linear maps of it."""
    out = [h0]
    for _ in range(n - 1):
        m = torch.randn(D, D, generator=gen) / D**0.5 + torch.eye(D)
        out.append(m @ h0)
    return out


def _complex_multiples_of_head0(
    h0: torch.Tensor, n: int, rotary: int, gen: torch.Generator
) -> list[torch.Tensor]:
    """Head 0 and ``n - 1`` heads whose rotary channel pairs ``(f, f + R/2)`` are complex multiples of
    head 0's, per frequency; channels past ``R`` are an invertible linear map of head 0's."""
    half = rotary // 2
    out = [h0]
    for _ in range(n - 1):
        c = torch.complex(torch.randn(half, generator=gen), torch.randn(half, generator=gen))
        z = torch.complex(h0[:half], h0[half:rotary]) * c[:, None]
        parts = [z.real, z.imag]
        if rotary < D:
            m = torch.randn(D - rotary, D - rotary, generator=gen) / D**0.5 + torch.eye(D - rotary)
            parts.append(m @ h0[rotary:])
        out.append(torch.cat(parts))
    return out


def _mergeable(family: str, kind: str):
    """A 4-head model whose K/V heads merge exactly into one: ``kind`` ``values`` (value heads are linear
    maps of one head, key heads identical) or ``keys`` (key heads are per-frequency complex multiples of
    one head, value heads identical)."""
    model = tiny_model(family, heads=4, kv_heads=4)
    gen = torch.Generator().manual_seed(1)
    rotary = {"phi": D // 2}.get(family, D)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            k0, v0 = _heads(attn.k_proj, 4)[0], _heads(attn.v_proj, 4)[0]
            k0 = k0 * 8  # random init gives near-uniform attention; sharpen it so keys matter
            attn.q_proj.weight.mul_(8)
            if kind == "values":
                _set_heads(attn.k_proj, [k0] * 4)
                _set_heads(attn.v_proj, _linear_maps_of_head0(v0, 4, gen))
            else:
                _set_heads(attn.k_proj, _complex_multiples_of_head0(k0, 4, rotary, gen))
                _set_heads(attn.v_proj, [v0] * 4)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: value biases through the affine column
def test_values_exact_when_value_heads_are_linear_maps_of_one(tmp_path, calib_txt, family):
    src = _save(_mergeable(family, "values"), tmp_path / "src")
    opts = dict(groups=1, calib_data=str(calib_txt), calib_tokens=512)
    res = convert_checkpoint(src, tmp_path / "cal", ConvertOptions(method="calibrated", **opts))
    convert_checkpoint(src, tmp_path / "mean", ConvertOptions(groups=1))
    ref = _logits(src)
    torch.testing.assert_close(_logits(tmp_path / "cal"), ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(_logits(tmp_path / "mean"), ref, rtol=1e-2, atol=1e-2)
    errors = res.provenance["reconstruction_error"]
    assert len(errors) == 2 and all(e["value"] < 1e-9 and e["key"] < 1e-9 for e in errors)


@pytest.mark.parametrize("family", ["llama", "phi", "qwen2"])  # phi: partial rotary; qwen2: key biases
def test_keys_exact_at_every_position_for_complex_multiples(tmp_path, calib_txt, family):
    src = _save(_mergeable(family, "keys"), tmp_path / "src")
    opts = dict(groups=1, calib_data=str(calib_txt), calib_tokens=512)
    convert_checkpoint(src, tmp_path / "cal", ConvertOptions(method="calibrated", **opts))
    convert_checkpoint(src, tmp_path / "mean", ConvertOptions(groups=1))
    ref = _logits(src)
    torch.testing.assert_close(_logits(tmp_path / "cal"), ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(_logits(tmp_path / "mean"), ref, rtol=1e-2, atol=1e-2)


def test_provenance_records_method_data_and_errors(tmp_path, calib_txt):
    src = _save(tiny_model("llama", heads=4, kv_heads=4), tmp_path / "src")
    opts = ConvertOptions(groups=2, method="calibrated", calib_data=str(calib_txt), calib_tokens=300)
    convert_checkpoint(src, tmp_path / "out", opts)
    prov = json.loads((tmp_path / "out" / "gqakit.json").read_text())
    assert prov["method"] == "calibrated" and prov["key_merge"] == "calibrated"
    assert prov["calibration"]["tokens"] == 300 and len(prov["calibration"]["sha256"]) == 64
    assert "queries" in prov["merge_objective"] and "o_proj" in prov["merge_objective"]
    assert prov["calibration"]["path"] == str(calib_txt.resolve())
    assert [e["layer"] for e in prov["reconstruction_error"]] == [0, 1]
    assert all(0 <= e["key"] < 1 and 0 <= e["value"] < 1 for e in prov["reconstruction_error"])


@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_every_family_calibrates_loads_and_keeps_g_equal_k_exact(tmp_path, calib_txt, family):
    kw = {"head_dim": 16} if family.startswith("gemma") else {}
    if family in ("phi", "stablelm"):
        kw["qk_layernorm"] = family == "stablelm"  # stablelm: per-head key norms -> mean-key fallback
    src = _save(tiny_model(family, heads=4, kv_heads=4, **kw), tmp_path / "src")
    opts = dict(method="calibrated", calib_data=str(calib_txt), calib_tokens=256)
    # G = K: every merge is an invertible map of one head, so the logits are the same.
    convert_checkpoint(src, tmp_path / "same", ConvertOptions(groups=4, **opts))
    torch.testing.assert_close(_logits(tmp_path / "same"), _logits(src), rtol=1e-4, atol=1e-4)
    res = convert_checkpoint(src, tmp_path / "g2", ConvertOptions(groups=2, **opts))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "g2").eval()
    assert model.config.num_key_value_heads == 2
    assert torch.isfinite(_logits(model)).all()
    normalized = family in ("qwen3", "gemma3_text", "olmo2", "stablelm")
    assert res.provenance["key_merge"].startswith("mean") == normalized


@pytest.mark.parametrize(
    ("family", "kw", "key_merge"),
    [
        # Phi3 rotates the first head_dim * partial_rotary_factor channels: a merge that pairs channels as
        # if all of head_dim rotated is no longer an invertible map of the keys at G = K
        ("phi3", {"partial_rotary_factor": 0.5}, "calibrated"),
        # phi with qk_layernorm normalizes keys after projection: the keys fall back to mean
        ("phi", {"qk_layernorm": True}, "mean"),
    ],
)
def test_g_equal_k_stays_exact_with_partial_rotary_and_key_norms(tmp_path, calib_txt, family, kw, key_merge):
    model = tiny_model(family, heads=4, kv_heads=4, **kw)
    with torch.no_grad():  # sharpen the near-uniform random attention, so that keys matter
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(8)
    src = _save(model, tmp_path / "src")
    opts = ConvertOptions(groups=4, method="calibrated", calib_data=str(calib_txt), calib_tokens=512)
    res = convert_checkpoint(src, tmp_path / "out", opts)
    assert res.provenance["key_merge"].startswith(key_merge)
    torch.testing.assert_close(_logits(tmp_path / "out"), _logits(src), rtol=1e-4, atol=1e-4)


def test_calibrated_beats_mean_on_calibration_error(tmp_path, calib_txt):
    """On a random model, the calibrated merge loses less output energy than mean pooling."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 9, generator=gen) @ torch.randn(9, 9, generator=gen)
    x = torch.cat([x, torch.ones(512, 1)], 1).double()
    gram = x.T @ x
    w = torch.randn(3, 4, 10, generator=gen, dtype=torch.float64)
    from gqakit.convert.merge import mean_merge

    for fit in (fit_value_merge, lambda w, g: fit_key_merge(w, g, 4)):
        assert merge_error(w, gram, fit(w, gram)) < merge_error(w, gram, mean_merge(3, 4))


def test_merge_in_a_metric_minimizes_the_error_in_that_metric():
    """Fitted through per-member scales, a merge beats the plain fit on the weighted error (and loses to it
    on the plain one): the metric changes what is kept, not just how it is measured."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 9, generator=gen, dtype=torch.float64)
    x = torch.cat([x, torch.ones(512, 1, dtype=torch.float64)], 1)
    gram = x.T @ x
    w = torch.randn(3, 4, 10, generator=gen, dtype=torch.float64)
    dense = torch.randn(3, 4, 4, generator=gen, dtype=torch.float64) + 2 * torch.eye(4, dtype=torch.float64)
    per_pair = torch.diag_embed(torch.rand(3, 2, generator=gen, dtype=torch.float64).repeat(1, 2) + 0.1)
    for fit, scales in ((fit_value_merge, dense), (lambda w, g: fit_key_merge(w, g, 4), per_pair)):
        plain = fit(w, gram)
        weighted = in_metric(lambda t, fit=fit: fit(t, gram), w, scales)
        assert merge_error(w, gram, weighted, scales) < 0.99 * merge_error(w, gram, plain, scales)
        assert merge_error(w, gram, plain) < 0.99 * merge_error(w, gram, weighted)


@pytest.mark.parametrize("kind", ["keys", "values"])
def test_errors_nothing_reads_cost_nothing(tmp_path, calib_txt, kind, monkeypatch):
    """K/V head 1's queries are zero (keys) or its o_proj columns are (values): the calibrated merge spends
    nothing on it and keeps head 0 exactly, so the logits stay; fitted on plain output error they do not."""
    model = tiny_model("llama", heads=4, kv_heads=2)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(8)  # sharpen the near-uniform random attention so keys matter
            same = attn.v_proj if kind == "keys" else attn.k_proj  # the other projection merges exactly
            same.weight[D:] = same.weight[:D]
            if kind == "keys":
                attn.q_proj.weight[2 * D :] = 0  # query heads 2, 3 read K/V head 1
            else:
                attn.o_proj.weight[:, 2 * D :] = 0
    src = _save(model, tmp_path / "src")
    opts = ConvertOptions(groups=1, method="calibrated", calib_data=str(calib_txt), calib_tokens=512)
    convert_checkpoint(src, tmp_path / "cal", opts)
    ref = _logits(src)
    torch.testing.assert_close(_logits(tmp_path / "cal"), ref, rtol=1e-4, atol=1e-4)

    from gqakit.convert import merge_fit

    def plain(*args, metrics=merge_fit.downstream_scales):
        ks, vs = metrics(*args)
        return torch.eye(D).expand_as(ks), torch.eye(D).expand_as(vs)

    monkeypatch.setattr(merge_fit, "downstream_scales", plain)
    convert_checkpoint(src, tmp_path / "plain", opts)
    assert not torch.allclose(_logits(tmp_path / "plain"), ref, rtol=1e-2, atol=1e-2)


def test_merge_functions_round_trip_identical_heads():
    """Identical heads merge into that head itself (scale normalization), with identity compensation."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    x = torch.cat(
        [torch.randn(64, 6, generator=gen, dtype=torch.float64), torch.ones(64, 1, dtype=torch.float64)], 1
    )
    w = torch.stack([h, h])
    for mg in (fit_value_merge(w, x.T @ x), fit_key_merge(w, x.T @ x, 4)):
        shared = merge_rows(w.reshape(8, 7), [mg], 4)
        assert abs(torch.linalg.norm(x @ shared.T) - torch.linalg.norm(x @ h.T)) < 1e-8
        q = torch.randn(8, 7, generator=gen, dtype=torch.float64)  # 2 query heads per K/V head... of 2 heads
        assert compensate_q_rows(q, [mg], 4, 1).shape == q.shape
        assert compensate_o_cols(torch.randn(5, 8, dtype=torch.float64), [mg], 4, 1).shape == (5, 8)


# ----------------------------------------------------------------------------------------------------
# Bad input


def test_calibrated_without_data_is_a_clear_error(tiny_llama, tmp_path):
    with pytest.raises(GqakitError, match="--method calibrated needs calibration text: give --calib-data"):
        convert_checkpoint(tiny_llama, tmp_path / "o", ConvertOptions(groups=2, method="calibrated"))
    assert not (tmp_path / "o").exists()


def test_all_option_problems_are_reported_at_once(tiny_llama, tmp_path):
    opts = ConvertOptions(groups=0, method="random", refine_steps=2, calib_tokens=0)
    with pytest.raises(GqakitError) as e:
        convert_checkpoint(tiny_llama, tmp_path / "o", opts)
    msg = str(e.value.message)
    for fragment in (
        "--groups",
        "--calib-tokens",
        "--calib-data",
        "--refine-steps cannot start from --method random",
    ):
        assert fragment in msg, msg


def _convert_calibrated(src, tmp_path, calib, groups: int, extra: tuple[str, ...] = ()):
    """``gqakit convert SRC tmp_path/o -g GROUPS --method calibrated --calib-data CALIB [extra]``."""
    args = ["convert", str(src), str(tmp_path / "o"), "-g", str(groups), "--method", "calibrated"]
    return CliRunner().invoke(main, [*args, "--calib-data", str(calib), *extra])


def test_missing_calibration_file(tiny_llama, tmp_path):
    res = _convert_calibrated(tiny_llama, tmp_path, tmp_path / "nope.txt", groups=2)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "--calib-data" in res.output and "nope.txt does not exist" in res.output


def test_too_short_calibration_data(tiny_llama, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Rivers carry sand to the sea.")
    res = _convert_calibrated(tiny_llama, tmp_path, short, groups=2)
    assert res.exit_code == 2, res.output
    assert "--calib-tokens asks for 4,096" in res.output and "pass --calib-tokens" in res.output
    assert not (tmp_path / "o").exists()


def test_calib_data_without_a_use_is_rejected(tiny_llama, tmp_path, calib_txt):
    used_by = "only used by --method calibrated or --refine-steps"
    with pytest.raises(GqakitError, match=used_by):
        convert_checkpoint(tiny_llama, tmp_path / "o", ConvertOptions(groups=2, calib_data=str(calib_txt)))


def test_cli_calibrated_convert(tiny_llama, tmp_path, calib_txt):
    res = _convert_calibrated(tiny_llama, tmp_path, calib_txt, groups=1, extra=("--calib-tokens", "256"))
    assert res.exit_code == 0, res.output
    assert "calibrated" in res.output
    prov = json.loads((tmp_path / "o" / "gqakit.json").read_text())
    assert prov["calibration"]["tokens"] == 256


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["values", "keys"])
def test_calibration_on_cuda_is_exact_like_on_cpu(tmp_path, calib_txt, kind):
    src = _save(_mergeable("llama", kind), tmp_path / "src")
    opts = dict(groups=1, method="calibrated", calib_data=str(calib_txt), calib_tokens=512)
    res = convert_checkpoint(src, tmp_path / "cuda", ConvertOptions(device="cuda", **opts))
    assert res.provenance["calibration"]["device"].startswith("cuda")
    torch.testing.assert_close(_logits(tmp_path / "cuda"), _logits(src), rtol=1e-4, atol=1e-4)
