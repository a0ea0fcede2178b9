"""Non-finite weights never pass through: convert, expand, export and eval refuse a checkpoint whose
tensor holds NaN/Inf, name the tensor and the count, exit non-zero and leave nothing at the destination."""

from __future__ import annotations

from contextlib import closing

import pytest
import torch
from click.testing import CliRunner
from tiny_models import checkpoint_tensors, save_tiny_model

from gqakit.cli import main
from gqakit.errors import GqakitError
from gqakit.safetensors_io import SafetensorsFile, nonfinite_count, save_state_dict

K_PROJ = "model.layers.0.self_attn.k_proj.weight"
DOWN_PROJ = "model.layers.1.mlp.down_proj.weight"  # copied byte for byte by convert


def _poison(path, name: str, bad: int = 3):
    """Put ``bad`` non-finite values (NaN, Inf, -Inf, ...) into tensor ``name`` of ``path``."""
    tensors = {k: v.clone() for k, v in checkpoint_tensors(path).items()}  # off the file we rewrite
    flat = tensors[name].view(-1)
    for i, value in zip(range(bad), [float("nan"), float("inf"), float("-inf")] * bad, strict=False):
        flat[7 * i] = value
    save_state_dict(tensors, path / "model.safetensors")
    return tensors[name].numel()


@pytest.fixture
def gqa(tmp_path):
    """8 query heads, 4 K/V heads, NaN/Inf in layer 0's k_proj."""
    path = save_tiny_model(tmp_path / "src", "llama", heads=8, kv_heads=4)
    return path, _poison(path, K_PROJ)


def _nothing_at(path) -> bool:
    siblings = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]
    partial = [p for p in path.parent.iterdir() if p.name.startswith(path.name) and p != path]
    return not path.exists() and not siblings and not partial


def _assert_refused(result, name: str, total: int) -> None:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    assert f"{name} " in result.output and f"holds 3 NaN/Inf values of {total}" in result.output, (
        result.output
    )
    assert "the checkpoint is corrupt" in result.output


def _run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_convert_refuses_a_nan_k_proj(gqa, tmp_path):
    src, total = gqa
    dst = tmp_path / "out"
    _assert_refused(_run("convert", src, dst, "--groups", "2", "--no-progress"), K_PROJ, total)
    assert _nothing_at(dst)


def test_convert_refuses_nan_in_a_tensor_it_copies_unchanged(tmp_path):
    src = save_tiny_model(tmp_path / "src", "llama", heads=8, kv_heads=4)
    total = _poison(src, DOWN_PROJ)
    dst = tmp_path / "out"
    _assert_refused(_run("convert", src, dst, "--groups", "2", "--no-progress"), DOWN_PROJ, total)
    assert _nothing_at(dst)


def test_convert_refuses_a_nan_k_proj_in_a_pytorch_bin(tmp_path):
    src = save_tiny_model(tmp_path / "src", "llama", heads=8, kv_heads=4)
    tensors = {k: v.clone() for k, v in checkpoint_tensors(src).items()}
    tensors[K_PROJ].view(-1)[:3] = float("nan")
    (src / "model.safetensors").unlink()
    torch.save(tensors, src / "pytorch_model.bin")
    dst = tmp_path / "out"
    _assert_refused(
        _run("convert", src, dst, "--groups", "2", "--no-progress"), K_PROJ, tensors[K_PROJ].numel()
    )
    assert _nothing_at(dst)


def test_expand_refuses_a_nan_k_proj(gqa, tmp_path):
    src, total = gqa
    dst = tmp_path / "mha"
    _assert_refused(_run("expand", src, dst, "--no-progress"), K_PROJ, total)
    assert _nothing_at(dst)


def test_export_refuses_a_nan_k_proj(gqa, tmp_path):
    pytest.importorskip("gguf")
    src, total = gqa
    dst = tmp_path / "m.gguf"
    _assert_refused(_run("export", src, dst, "--type", "f16", "--no-progress"), K_PROJ, total)
    assert _nothing_at(dst)


def test_eval_refuses_a_nan_model_before_measuring(gqa, tmp_path):
    src, total = gqa
    text = tmp_path / "text.txt"
    text.write_text("Rivers carry sand to the sea, where waves sort it into beaches of fine grains. " * 4)
    out = tmp_path / "report"
    result = _run(
        "eval", src, "--ppl-data", text, "--seq-len", "32", "--device", "cpu", "--out", out, "--no-progress"
    )
    _assert_refused(result, K_PROJ, total)
    assert _nothing_at(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_raw_copies_count_nonfinite_values_in_every_float_dtype(tmp_path, dtype):
    """A run of tensors copied as one byte range: the bad one is named, integer tensors pass undecoded."""
    good = torch.ones(4, 4).to(dtype)
    bad = torch.ones(4, 4)
    bad[0, :2] = float("nan")
    tensors = {"a": good, "ids": torch.arange(6), "b": bad.to(dtype), "c": good.clone()}
    save_state_dict(tensors, tmp_path / "m.safetensors")
    with closing(SafetensorsFile(tmp_path / "m.safetensors")) as f, open(tmp_path / "out", "wb") as out:
        a, c = f.tensors["a"], f.tensors["c"]
        f.copy_raw("a", out)
        f.copy_raw("ids", out)
        with pytest.raises(GqakitError, match=r"^b \(in .*\) holds 2 NaN/Inf values of 16: the checkpoint"):
            f.copy_bytes(a.start, c.end - a.start, out)
        with pytest.raises(GqakitError, match="b .*holds 2 NaN/Inf values of 16"):
            f.read("b")
        assert f.read("ids").tolist() == list(range(6))
        out.seek(0)
        f.copy_bytes(a.start, f.tensors["ids"].end - a.start, out)  # a and ids: copied whole
    raw = (tmp_path / "m.safetensors").read_bytes()[a.start : f.tensors["ids"].end]
    assert (tmp_path / "out").read_bytes()[: len(raw)] == raw


def test_nonfinite_count():
    assert nonfinite_count(torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])) == 3
    assert nonfinite_count(torch.tensor([1.0, 2.0]).to(torch.float8_e5m2)) == 0
    assert nonfinite_count(torch.arange(4)) == 0
    assert nonfinite_count(torch.empty(0)) == 0
