"""Bad input: one clear message that names the value and the fix, a non-zero exit, nothing written."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from tiny_models import save_tiny_model

from gqakit.cli import main


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _assert_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in result.output, f"{f!r} not in {result.output!r}"


@pytest.fixture
def gqa(tmp_path):
    """8 query heads, 4 K/V heads."""
    return save_tiny_model(tmp_path / "gqa", "llama", heads=8, kv_heads=4)


def _nothing_at(path) -> bool:
    siblings = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]
    return not path.exists() and not siblings


def test_missing_source(tmp_path):
    _assert_error(_run("convert", str(tmp_path / "nope"), str(tmp_path / "out"), "-g", "1"), "does not exist")
    assert _nothing_at(tmp_path / "out")


def test_source_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    _assert_error(
        _run("convert", str(tmp_path / "empty"), str(tmp_path / "out"), "-g", "1"), "has no config.json"
    )


def test_groups_not_positive(gqa, tmp_path):
    _assert_error(_run("convert", str(gqa), str(tmp_path / "out"), "-g", "0"), "--groups must be a positive")
    assert _nothing_at(tmp_path / "out")


def test_groups_not_dividing_lists_valid(gqa, tmp_path):
    _assert_error(
        _run("convert", str(gqa), str(tmp_path / "out"), "-g", "3"), "does not divide the 4", "1, 2, 4"
    )
    assert _nothing_at(tmp_path / "out")


def test_groups_above_kv_heads_suggests_expand(gqa, tmp_path):
    _assert_error(
        _run("convert", str(gqa), str(tmp_path / "out"), "-g", "8"),
        "more than the 4 K/V heads",
        "gqakit expand",
    )


def test_unsupported_family_says_why(tmp_path):
    import torch

    from gqakit.safetensors_io import save_state_dict

    d = tmp_path / "bloom"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"model_type": "bloom", "n_head": 4, "hidden_size": 16, "n_layer": 1})
    )
    save_state_dict(
        {"h.0.self_attention.query_key_value.weight": torch.zeros(48, 16)}, d / "model.safetensors"
    )
    res = _run("convert", str(d), str(tmp_path / "out"), "-g", "1")
    _assert_error(
        res, "'bloom' cannot run with fewer K/V heads", "query_key_value", "Supported families: gemma"
    )
    assert _nothing_at(tmp_path / "out")


def test_unsupported_family_message(tiny_llama, tmp_path):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    for model_type, expected in [
        ("gptj", "cannot run with fewer K/V heads"),
        ("lama", 'Did you mean "llama"'),
    ]:
        (tiny_llama / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
        _assert_error(
            _run("convert", str(tiny_llama), str(tmp_path / "out"), "-g", "1"), expected, "Supported families"
        )
    assert _nothing_at(tmp_path / "out")


def test_truncated_safetensors(tiny_llama, tmp_path):
    f = tiny_llama / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _assert_error(
        _run("convert", str(tiny_llama), str(tmp_path / "out"), "-g", "2"), "truncated", "model.safetensors"
    )
    assert _nothing_at(tmp_path / "out")


def test_corrupt_safetensors_header(tiny_llama, tmp_path):
    f = tiny_llama / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"garbage!"
    f.write_bytes(bytes(data))
    _assert_error(
        _run("convert", str(tiny_llama), str(tmp_path / "out"), "-g", "2"), "not a valid safetensors file"
    )


def test_index_naming_missing_shard(tmp_path):
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4, layers=4, max_shard_size="60KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (src / victim).unlink()
    _assert_error(_run("convert", str(src), str(tmp_path / "out"), "-g", "2"), victim, "incomplete")


def test_dst_inside_src(tiny_llama):
    _assert_error(_run("convert", str(tiny_llama), str(tiny_llama / "sub"), "-g", "2"), "inside the source")
    assert not (tiny_llama / "sub").exists()


@pytest.mark.parametrize("force", [False, True])
def test_dst_containing_src_is_refused_before_force_could_delete_it(tmp_path, force):
    """``gqakit convert models/llama-src models --force`` would replace models/, the source with it."""
    models = tmp_path / "models"
    src = save_tiny_model(models / "llama-src", "llama", tokenizer=False)
    (models / "notes.txt").write_text("mine")
    before = sorted(p.name for p in src.iterdir())
    args = ["convert", str(src), str(models), "-g", "2", *(["--force"] if force else [])]
    # the message is the same with or without --force: it must not suggest --force
    _assert_error(_run(*args), f"Output {models} contains the source {src}", f"{models / 'llama-src-gqa'}")
    assert sorted(p.name for p in src.iterdir()) == before
    assert (models / "notes.txt").read_text() == "mine"
    assert not [p for p in models.iterdir() if p.name.startswith(".")]  # nothing half-written


def test_existing_dst_needs_force(tiny_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _assert_error(_run("convert", str(tiny_llama), str(out), "-g", "2"), "--force")
    assert (out / "keep.txt").read_text() == "mine"
    res = _run("convert", str(tiny_llama), str(out), "-g", "2", "--force")
    assert res.exit_code == 0, res.output
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_failure_midway_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    import gqakit.convert.stream as stream

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(stream.SafetensorsWriter, "write_tensor", boom)
    res = _run("convert", str(tiny_llama), str(tmp_path / "out"), "-g", "2")
    assert res.exit_code != 0
    assert _nothing_at(tmp_path / "out")


def test_hub_id_offline_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _assert_error(
        _run("convert", "some-org/some-model", str(tmp_path / "out"), "-g", "1"),
        "Hugging Face Hub",
        "offline",
    )


def test_config_not_matching_weights(tiny_llama, tmp_path):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    (tiny_llama / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 2}))
    _assert_error(
        _run("convert", str(tiny_llama), str(tmp_path / "out"), "-g", "1"), "does not match the weights"
    )
