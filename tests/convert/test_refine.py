"""Layer-wise refinement: it brings the converted model closer to the original, stays a plain checkpoint,
never makes a layer worse, and rejects bad options with a clear message."""

from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner
from tiny_models import TINY_TEXT, checkpoint_tensors, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM

from gqakit.checkpoint import resolve_checkpoint
from gqakit.cli import main
from gqakit.convert import ADAPTERS, ConvertOptions, convert_checkpoint
from gqakit.convert.decoder_stream import DecoderStream
from gqakit.convert.refine import REFINE_LR, REFINE_TARGETS, fit_block, token_weights
from gqakit.errors import GqakitError
from gqakit.pipelines.probe import attention_errors

WORDS = TINY_TEXT.split()


def _shuffled_words(seed: int, n: int) -> str:
    """Text from the tiny tokenizer's vocabulary in an order of its own: held-out text differs from the
    calibration text by its word sequences, not by its vocabulary."""
    return " ".join(random.Random(seed).choices(WORDS, k=n))


# Held-out ids (not the calibration text) on which the converted models are compared.
IDS = torch.tensor(tiny_tokenizer()(_shuffled_words(2, 400))["input_ids"][:192]).reshape(2, 96)


@pytest.fixture(scope="module")
def calib_txt(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(_shuffled_words(1, 2000))
    return path


@pytest.fixture(scope="module")
def sharp_llama(tmp_path_factory):
    """A 4-head MHA llama whose attention is far from uniform (random init is near-uniform, where keys
    hardly matter and any merge looks good)."""
    model = tiny_model("llama", heads=4, kv_heads=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    path = tmp_path_factory.mktemp("sharp") / "src"
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def _logits(path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(IDS).logits


def _kl(path, ref: torch.Tensor) -> float:
    """Mean KL(original || converted) of the next-token distributions on IDS."""
    got = _logits(path).log_softmax(-1)
    ref = ref.log_softmax(-1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def _heldout_attention_errors(src, converted) -> list[float]:
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    return attention_errors(original, model, ADAPTERS["llama"], 2, list(IDS))


# (method, held-out attention error ratio, KL ratio) that refinement must beat: from the calibrated merge
# the tiny random model has less to win than from mean pooling
@pytest.mark.parametrize(("method", "gain", "kl_gain"), [("calibrated", 0.95, 1.0), ("mean", 0.8, 0.8)])
def test_refinement_brings_the_converted_model_closer_to_the_original(
    sharp_llama, tmp_path, calib_txt, method, gain, kl_gain
):
    opts = dict(groups=1, method=method, calib_data=str(calib_txt), calib_tokens=2048)
    if method == "mean":
        base = convert_checkpoint(sharp_llama, tmp_path / "base", ConvertOptions(groups=1))
    else:
        base = convert_checkpoint(sharp_llama, tmp_path / "base", ConvertOptions(**opts))
    res = convert_checkpoint(
        sharp_llama, tmp_path / "ref", ConvertOptions(refine_steps=60, refine_lr=1e-3, **opts)
    )
    rec = res.provenance["refine"]
    assert rec["steps"] == 60 and rec["tokens"] + rec["heldout_tokens"] == 2048
    assert len(rec["attention_error"]) == 2
    assert all(e["after"] < e["before"] and e["best_step"] > 0 for e in rec["attention_error"])
    # on held-out text: each attention block's output and the next-token distributions are closer to
    # the original's
    base_err = _heldout_attention_errors(sharp_llama, tmp_path / "base")
    ref_err = _heldout_attention_errors(sharp_llama, tmp_path / "ref")
    assert all(r < gain * b for r, b in zip(ref_err, base_err, strict=True)), (ref_err, base_err)
    ref = _logits(sharp_llama)
    assert _kl(tmp_path / "ref", ref) < kl_gain * _kl(tmp_path / "base", ref)
    # a plain checkpoint of the converted shape, loadable by vanilla transformers
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert config["num_key_value_heads"] == 1 and base.files == res.files


def test_a_diverging_fit_keeps_the_merge(sharp_llama, tmp_path, calib_txt):
    """A learning rate far too high makes Adam diverge; each layer then keeps its merged weights."""
    opts = dict(groups=1, method="calibrated", calib_data=str(calib_txt), calib_tokens=1024)
    convert_checkpoint(sharp_llama, tmp_path / "cal", ConvertOptions(**opts))
    res = convert_checkpoint(
        sharp_llama, tmp_path / "bad", ConvertOptions(refine_steps=5, refine_lr=50.0, **opts)
    )
    errors = res.provenance["refine"]["attention_error"]
    assert all(e["best_step"] == 0 and e["heldout_after"] == e["heldout_before"] for e in errors)
    assert res.provenance["refine"]["summary"].startswith("refinement kept no step")
    torch.testing.assert_close(_logits(tmp_path / "bad"), _logits(tmp_path / "cal"))


def _final_hidden_error(src, converted) -> float:
    """Relative squared error of the final (normed) hidden state, each model run end to end on IDS."""
    states = []
    for path in (src, converted):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            states.append(model(IDS, output_hidden_states=True, use_cache=False).hidden_states[-1])
    return float((states[1] - states[0]).pow(2).sum() / states[0].pow(2).sum())


def test_layer_corrective_fits_per_token_moves_only_attention_and_ends_closer(
    sharp_llama, tmp_path, calib_txt
):
    """layer-corrective: each block in a copy of its decoder layer, reading the converted model's states,
    aimed at the original layer's output with the per-token loss; only attention weights move, and end to
    end the last hidden state is closer to the original's than after the attention target."""
    assert {t: REFINE_TARGETS[t].loss for t in REFINE_TARGETS} == {
        "attention": "relative",
        "layer-corrective": "per-token",
    }
    opts = dict(groups=1, method="calibrated", calib_data=str(calib_txt), calib_tokens=2048, refine_steps=60)
    attn = convert_checkpoint(sharp_llama, tmp_path / "attn", ConvertOptions(**opts))
    res = convert_checkpoint(
        sharp_llama, tmp_path / "corr", ConvertOptions(refine_target="layer-corrective", **opts)
    )
    rec = res.provenance["refine"]
    assert (rec["target"], rec["loss"]) == ("layer-corrective", "per-token")
    assert attn.provenance["refine"]["loss"] == "relative"
    assert "mean square of the residual state" in rec["objective"]
    assert all(r["heldout_after"] <= r["heldout_before"] for r in rec["attention_error"])
    src, a, b = (checkpoint_tensors(p) for p in (sharp_llama, tmp_path / "attn", tmp_path / "corr"))
    assert any(not torch.equal(a[k], b[k]) for k in a if ".layers.1.self_attn." in k)
    assert all(torch.equal(src[k], b[k]) for k in src if ".self_attn." not in k)  # MLP, norms, embedding
    assert _final_hidden_error(sharp_llama, tmp_path / "corr") < _final_hidden_error(
        sharp_llama, tmp_path / "attn"
    )


def test_the_query_key_side_takes_its_own_rate_at_every_step(monkeypatch):
    """Every step's rates, as Adam sees them: the query/key side's and the rest's, the same throughout."""
    seen: list[list[float]] = []
    step = torch.optim.Adam.step

    def recording(self, *a, **kw):
        seen.append([g["lr"] for g in self.param_groups])
        return step(self, *a, **kw)

    monkeypatch.setattr(torch.optim.Adam, "step", recording)
    torch.manual_seed(0)
    block = torch.nn.Linear(8, 8)
    data = [((torch.randn(4, 8),), {}, torch.randn(4, 8)) for _ in range(3)]
    fit_block(block, data[:2], data[2:], steps=20, lr=1e-3, qk_lr=3e-3, qk_params=["weight"])
    assert len(seen) == 20
    rest, qk = zip(*seen, strict=True)
    assert set(qk) == {3e-3} and set(rest) == {1e-3}


def test_the_per_token_loss_keeps_a_massive_token_from_owning_the_fit():
    """A first token held at ~100x the others' size (a model's massive activation) with a target no
    linear map reaches: the relative loss spends the fit on it, the per-token loss on the rest."""
    torch.manual_seed(0)
    true = torch.randn(8, 8)

    def batch() -> tuple:
        x = torch.randn(2, 16, 8)
        y = x @ true.T
        y[:, 0] = 300 * torch.randn(2, 8)
        return (x,), {}, y

    data = [batch() for _ in range(5)]
    ordinary = {}
    for loss, weights in (("relative", None), ("per-token", [token_weights(t) for _, _, t in data])):
        torch.manual_seed(1)
        block = torch.nn.Linear(8, 8, bias=False)
        fit_block(block, data[:4], data[4:], steps=300, lr=3e-2, weights=weights)
        (x,), _, y = data[4]
        with torch.no_grad():  # held-out relative error on the ordinary tokens
            ordinary[loss] = float((block(x)[:, 1:] - y[:, 1:]).pow(2).sum() / y[:, 1:].pow(2).sum())
    assert ordinary["per-token"] < 0.01 < ordinary["relative"], ordinary


def test_a_separate_query_key_rate_moves_that_side_at_its_own_pace(sharp_llama, tmp_path, calib_txt):
    opts = dict(groups=1, method="calibrated", calib_data=str(calib_txt), calib_tokens=2048)
    convert_checkpoint(sharp_llama, tmp_path / "cal", ConvertOptions(**opts))
    res = convert_checkpoint(
        sharp_llama, tmp_path / "qk", ConvertOptions(refine_steps=30, refine_qk_lr=1e-12, **opts)
    )
    assert res.provenance["refine"]["qk_lr"] == 1e-12
    a, b = checkpoint_tensors(tmp_path / "cal"), checkpoint_tensors(tmp_path / "qk")
    for k in a:
        if ".q_proj." in k or ".k_proj." in k:  # a rate of 1e-12: Adam moves them by ~1e-11 at most
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)  # (the merge's own rounding: 1e-7)
    vo = [float((a[k] - b[k]).abs().max()) for k in a if ".v_proj." in k or ".o_proj." in k]
    assert max(vo) > 1e-3, vo


@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_every_family_refines_and_loads(tmp_path, calib_txt, family):
    """The converted attention block is rebuilt from each family's own class, fitted, and written back:
    some layer improves on held-out calibration text, and the output loads."""
    kw = {"head_dim": 16} if family.startswith("gemma") else {}
    if family in ("phi", "stablelm"):
        kw["qk_layernorm"] = family == "stablelm"
    model = tiny_model(family, heads=4, kv_heads=4, **kw)
    with torch.no_grad():  # sharpen the near-uniform random attention, so the merge leaves work to do
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(6)
    model.save_pretrained(tmp_path / "src")
    tiny_tokenizer(model.config.vocab_size).save_pretrained(tmp_path / "src")
    opts = ConvertOptions(
        groups=2,
        method="calibrated",
        calib_data=str(calib_txt),
        calib_tokens=1024,
        refine_steps=8,
        refine_lr=1e-3,
    )
    res = convert_checkpoint(tmp_path / "src", tmp_path / "out", opts)
    errors = res.provenance["refine"]["attention_error"]
    assert len(errors) == model.config.num_hidden_layers
    assert all(e["heldout_after"] <= e["heldout_before"] for e in errors)
    assert any(e["best_step"] > 0 and e["heldout_after"] < e["heldout_before"] for e in errors), errors
    assert torch.isfinite(_logits(tmp_path / "out")).all()


@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_decoder_stream_feeds_each_attention_what_the_full_forward_does(family, tmp_path):
    """Running the original one decoder layer at a time, each layer's weights loaded from the shards on
    its turn, gives every attention block the same inputs and outputs as one ordinary forward pass
    (per-layer masks and rotary tables included)."""
    # gemma2/3: a window shorter than the batches, so sliding and global layers get different masks
    kw = {"head_dim": 16, "sliding_window": 16} if family.startswith("gemma") else {}
    model = tiny_model(family, heads=4, kv_heads=2, **kw).eval()
    model.save_pretrained(tmp_path / "m")
    adapter = ADAPTERS[family]
    paths = [adapter.attention_module(i) for i in range(model.config.num_hidden_layers)]
    batches = [IDS[:, :40], IDS[:, 40:90]]  # two batches of different lengths
    want: dict[int, list] = {i: [] for i in range(len(paths))}
    hooks = [
        model.get_submodule(p).register_forward_hook(
            lambda _m, _a, out, i=i: want[i].append(out[0] if isinstance(out, tuple) else out)
        )
        for i, p in enumerate(paths)
    ]
    with torch.no_grad():
        for b in batches:
            model.base_model(input_ids=b, use_cache=False)
    for h in hooks:
        h.remove()
    with resolve_checkpoint(tmp_path / "m") as ckpt, ckpt.reader() as reader:
        stream = DecoderStream(ckpt, reader, adapter, batches, torch.device("cpu"))
        hidden = stream.hidden
        for i in range(len(paths)):
            got: list = []
            with stream.layer(i) as layer:
                attn = layer.get_submodule(stream.attention_name)
                hook = attn.register_forward_hook(lambda _m, _a, out, got=got: got.append(out[0]))
                hidden = stream.run(i, layer, hidden)
                hook.remove()
            assert all(p.device.type == "meta" for p in stream.layers[i].parameters())  # freed
            assert len(got) == 2
            for out, ref in zip(got, want[i], strict=True):
                torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_refine_options_are_checked_together(tiny_llama, tmp_path):
    opts = ConvertOptions(groups=2, method="random", refine_steps=-1, refine_lr=0.0)
    with pytest.raises(GqakitError) as e:
        convert_checkpoint(tiny_llama, tmp_path / "o", opts)
    msg = e.value.message
    assert "--refine-steps must be 0 (off) or a positive step count, got -1" in msg
    assert "--set refine_lr must be a finite learning rate above 0, got 0.0" in msg
    assert not (tmp_path / "o").exists()
    bad = ConvertOptions(groups=2, method="calibrated", refine_target="layer", refine_qk_lr=-1.0)
    with pytest.raises(GqakitError) as e:
        convert_checkpoint(tiny_llama, tmp_path / "o", bad)
    assert (
        "--set refine_target 'layer' is unknown; choose one of attention, layer-corrective" in e.value.message
    )
    assert "--set refine_qk_lr must be a finite learning rate above 0, got -1.0" in e.value.message


@pytest.mark.parametrize("bad", ["inf", "nan", "-inf"])
def test_cli_refuses_non_finite_refine_rates_with_the_other_problems(tiny_llama, tmp_path, calib_txt, bad):
    # inf > 0: a positivity check alone let it through, and the conversion then "refined" nothing
    args = ["convert", str(tiny_llama), str(tmp_path / "o"), "-g", "1", "--method", "calibrated"]
    extra = ["--calib-data", str(calib_txt), "--calib-tokens", "0", "--refine-steps", "2"]
    res = CliRunner().invoke(
        main, [*args, *extra, "--set", f"refine_lr={bad}", "--set", f"refine_qk_lr={bad}"]
    )
    assert res.exit_code != 0
    out = " ".join(res.output.split())  # click wraps the message
    assert "--calib-tokens must be a positive number of tokens, got 0." in out
    for flag, default in (("--set refine_lr", "0.001"), ("--set refine_qk_lr", "0.003")):
        assert (
            f"{flag} must be a finite learning rate above 0, got {float(bad)}; e.g. {default} (the default)."
            in out
        )
    assert not (tmp_path / "o").exists()


def test_refine_without_data_or_from_random_is_a_clear_error(tiny_llama, tmp_path, calib_txt):
    with pytest.raises(GqakitError, match="--refine-steps needs calibration text: give --calib-data"):
        convert_checkpoint(tiny_llama, tmp_path / "o", ConvertOptions(groups=2, refine_steps=10))
    with pytest.raises(GqakitError, match="--refine-steps cannot start from --method random"):
        convert_checkpoint(
            tiny_llama,
            tmp_path / "o",
            ConvertOptions(groups=2, method="random", calib_data=str(calib_txt), refine_steps=10),
        )
    assert not (tmp_path / "o").exists()


def test_one_calibration_sequence_is_too_few(tiny_llama, tmp_path, calib_txt):
    opts = ConvertOptions(groups=2, calib_data=str(calib_txt), calib_tokens=200, refine_steps=10)
    with pytest.raises(GqakitError, match="needs at least 2 calibration sequences .* raise --calib-tokens"):
        convert_checkpoint(tiny_llama, tmp_path / "o", opts)
    assert not (tmp_path / "o").exists()


def test_cli_refine(tiny_llama, tmp_path, calib_txt):
    args = ["convert", str(tiny_llama), str(tmp_path / "o"), "-g", "1", "--method", "calibrated"]
    extra = ["--calib-data", str(calib_txt), "--calib-tokens", "512", "--refine-steps", "4"]
    res = CliRunner().invoke(main, [*args, *extra])
    assert res.exit_code == 0, res.output
    assert "refined 4 steps/layer" in res.output
    prov = json.loads((tmp_path / "o" / "gqakit.json").read_text())
    assert prov["refine"]["steps"] == 4 and prov["refine"]["lr"] == REFINE_LR


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_refinement_on_cuda_improves_like_on_cpu(sharp_llama, tmp_path, calib_txt):
    opts = dict(groups=1, method="calibrated", calib_data=str(calib_txt), calib_tokens=2048, refine_steps=60)
    cpu = convert_checkpoint(
        sharp_llama, tmp_path / "cpu", ConvertOptions(device="cpu", refine_lr=1e-3, **opts)
    )
    gpu = convert_checkpoint(
        sharp_llama, tmp_path / "gpu", ConvertOptions(device="cuda", refine_lr=1e-3, **opts)
    )
    layers = zip(
        cpu.provenance["refine"]["attention_error"], gpu.provenance["refine"]["attention_error"], strict=True
    )
    for c, g in layers:
        assert g["heldout_after"] < g["heldout_before"]
        assert g["heldout_after"] == pytest.approx(c["heldout_after"], rel=0.2, abs=1e-3)
