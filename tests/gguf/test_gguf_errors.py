"""Bad input to the exporter: one clear message each, and never a half-written file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_helpers import make_checkpoint
from tiny_models import save_tiny_model

import gqakit.gguf.export as export_mod
from gqakit.errors import GqakitError
from gqakit.gguf.export import export_gguf


def _set_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_family_names_the_supported_ones(checkpoint, tmp_path: Path) -> None:
    src = save_tiny_model(tmp_path / "olmo", "olmo", heads=4, kv_heads=2)
    with pytest.raises(GqakitError) as err:
        export_gguf(src, tmp_path / "o.gguf")
    msg = str(err.value)
    assert "'olmo'" in msg and "gemma2, gemma3_text, gpt_bigcode, llama, mistral, phi, phi3, qwen2" in msg
    assert not (tmp_path / "o.gguf").exists()


def test_misspelled_family_gets_a_suggestion(tmp_path: Path) -> None:
    src = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    _set_config(src, model_type="llamma")
    with pytest.raises(GqakitError, match='Did you mean "llama"'):
        export_gguf(src, tmp_path / "o.gguf")


def test_unknown_out_type(checkpoint, tmp_path: Path) -> None:
    with pytest.raises(
        GqakitError, match="'fp16' is unknown. Did you mean \"f16\"\\? Choose one of f32, f16, q8_0"
    ):
        export_gguf(checkpoint("llama", "gqa"), tmp_path / "o.gguf", "fp16")


def test_existing_output_needs_force(checkpoint, tmp_path: Path) -> None:
    dst = tmp_path / "o.gguf"
    dst.write_bytes(b"keep me")
    with pytest.raises(GqakitError, match="exists: pass --force"):
        export_gguf(checkpoint("llama", "gqa"), dst)
    assert dst.read_bytes() == b"keep me"
    r = export_gguf(checkpoint("llama", "gqa"), dst, force=True)
    assert dst.read_bytes()[:4] == b"GGUF" and r.bytes == dst.stat().st_size


def test_directory_as_output(checkpoint, tmp_path: Path) -> None:
    with pytest.raises(GqakitError, match="is a directory"):
        export_gguf(checkpoint("llama", "gqa"), tmp_path)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, OSError])
def test_nothing_is_left_after_a_failure_mid_write(
    checkpoint, tmp_path: Path, monkeypatch, interrupt
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "o.gguf"
    real, calls = export_mod.GgufTensor.encode, []

    def failing(self, t):
        calls.append(self.name)
        if len(calls) == 3:
            raise interrupt("stop")
        return real(self, t)

    monkeypatch.setattr(export_mod.GgufTensor, "encode", failing)
    with pytest.raises(interrupt):
        export_gguf(checkpoint("llama", "gqa"), dst)
    assert len(calls) == 3  # it failed while writing tensors, after the header was on disk
    assert list(out.iterdir()) == []


def test_a_failure_with_force_keeps_the_old_file(checkpoint, tmp_path: Path, monkeypatch) -> None:
    dst = tmp_path / "o.gguf"
    dst.write_bytes(b"old")
    monkeypatch.setattr(
        export_mod.GgufTensor, "encode", lambda self, t: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    with pytest.raises(KeyboardInterrupt):
        export_gguf(checkpoint("llama", "gqa"), dst, force=True)
    assert dst.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["o.gguf"]


def test_missing_config_fields_are_reported_together(tmp_path: Path) -> None:
    src = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["rms_norm_eps"], cfg["intermediate_size"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GqakitError, match="lacks 'intermediate_size'; config.json lacks 'rms_norm_eps'"):
        export_gguf(src, tmp_path / "o.gguf")


def test_unsupported_rope_scaling_is_refused(tmp_path: Path) -> None:
    src = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    _set_config(src, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(GqakitError, match="rope_type 'dynamic' has no GGUF form.*default, llama3, linear"):
        export_gguf(src, tmp_path / "o.gguf")


def test_linear_rope_scaling_is_written(tmp_path: Path) -> None:
    from gguf_helpers import read_gguf

    src = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    _set_config(src, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    meta = read_gguf(export_gguf(src, tmp_path / "o.gguf").path)[2]
    assert meta["llama.rope.scaling.type"] == "linear" and meta["llama.rope.scaling.factor"] == 4.0


def test_llama3_rope_scaling_writes_rope_freqs(tmp_path: Path) -> None:
    from gguf_helpers import read_gguf

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
    src = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2, rope_parameters=rope)
    values = read_gguf(export_gguf(src, tmp_path / "o.gguf").path)[0]
    factors = values["rope_freqs.weight"]
    assert factors.shape == (8,)  # head_dim 16 / 2
    # high frequencies (short wavelengths) are kept, low ones divided by the factor 8
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)


def test_gemma_with_its_own_lm_head_is_refused(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path, "gemma", 2, tie_word_embeddings=False)
    with pytest.raises(GqakitError, match="has its own lm_head.*always projects with the token embedding"):
        export_gguf(src, tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(GqakitError, match="does not exist"):
        export_gguf(tmp_path / "nope", tmp_path / "o.gguf")


def test_relu_gpt_bigcode_is_refused_by_llama_cpps_gelu_graph(tmp_path):
    # OPT converts into gpt_bigcode with ReLU; llama.cpp's starcoder graph applies GELU regardless
    from tiny_models import save_tiny_model

    from gqakit.convert import ConvertOptions, convert_checkpoint
    from gqakit.errors import GqakitError
    from gqakit.gguf.export import export_gguf

    src = save_tiny_model(tmp_path / "opt", "opt", ffn_dim=128, word_embed_proj_dim=64)
    convert_checkpoint(src, tmp_path / "bigcode", ConvertOptions(groups=1))
    with pytest.raises(GqakitError, match=r"activation_function='relu': llama.cpp's graph .* applies GELU"):
        export_gguf(tmp_path / "bigcode", tmp_path / "out.gguf", "f32")
    assert not (tmp_path / "out.gguf").exists()


def test_export_shows_its_progress_in_bytes_unless_told_not_to(checkpoint, tmp_path: Path, capfd) -> None:
    """The bar counts the tensor bytes written; ``--no-progress`` keeps logs clean."""
    from gqakit.cli import main

    src = checkpoint("llama", "gqa")
    export_gguf(src, tmp_path / "shown.gguf")
    assert "export -> f16" in capfd.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["export", str(src), str(tmp_path / "quiet.gguf"), "--no-progress"])
    assert done.value.code == 0 and (tmp_path / "quiet.gguf").stat().st_size > 0
    assert "export -> " not in capfd.readouterr().err
