"""Bad input across the shared layer and the verbs: one clear message naming the bad value and the fix,
a non-zero exit, nothing half-written. One row per case; add a row with every new message."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from gqakit.cli import main
from gqakit.testing import save_tiny_model


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A directory in which nothing can be created: a chmod 555 directory, or for root (who ignores
    permissions) a path under sysfs."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d
    probe = Path("/sys/gqakit-write-probe")
    try:
        probe.mkdir()
    except OSError:
        return Path("/sys")
    probe.rmdir()
    pytest.skip("no unwritable directory available")


def _encoder(tmp_path: Path) -> Path:
    """A tiny BERT checkpoint saved as a masked-LM encoder."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64)  # fmt: skip
    BertForMaskedLM(cfg).save_pretrained(tmp_path / "bert")
    return tmp_path / "bert"


def _truncated(tmp_path: Path) -> Path:
    src = save_tiny_model(tmp_path / "trunc", "llama", heads=4, kv_heads=4)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return src


def _lying_config(tmp_path: Path) -> Path:
    """Weights with 4 K/V heads under a config that claims 8 query and 8 K/V heads."""
    src = save_tiny_model(tmp_path / "lie", "llama", heads=4, kv_heads=4)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(num_attention_heads=8, num_key_value_heads=8, head_dim=16)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_an_encoder_is_refused_by_name(tmp_path):
    from gqakit.errors import GqakitError
    from gqakit.models import load_causal_lm

    with pytest.raises(
        GqakitError, match=r"'bert' checkpoint \(BertForMaskedLM\), not a decoder-only causal"
    ):
        load_causal_lm(_encoder(tmp_path), dtype="float32", device="cpu")


def test_a_truncated_shard_is_named_not_a_traceback(tmp_path):
    from gqakit.errors import GqakitError
    from gqakit.models import load_causal_lm

    with pytest.raises(GqakitError, match=r"model.safetensors.*truncated"):
        load_causal_lm(_truncated(tmp_path), dtype="float32", device="cpu")


CLI_CASES = [
    # (id, argv builder, message fragment)
    ("convert-unwritable-parent",
     lambda t, u: ["convert", str(_tiny(t)), str(u / "out"), "-g", "2"],
     "Cannot write the output"),
    ("eval-unwritable-out-before-evaluating",
     lambda t, u: ["eval", str(_tiny(t)), "--ppl-data", str(_file(t)), "--out", str(u / "report")],
     "report cannot be written"),
    ("eval-an-encoder",
     lambda t, u: ["eval", str(_encoder(t)), "--ppl-data", str(_file(t))],
     "not a decoder-only causal language model"),
    ("inspect-config-lies-about-heads",
     lambda t, u: ["inspect", str(_lying_config(t))],
     "the config implies"),
    ("convert-device-cuda-01",
     lambda t, u: ["convert", "SRC", "DST", "--groups", "1", "--device", "cuda:01"],
     "--device must be auto, cpu, cuda or cuda:N, got 'cuda:01'."),
    *[
        (f"{argv[0]}-device-gpu", lambda t, u, argv=argv: [*argv, "--device", "gpu"],
         "--device must be auto, cpu, cuda or cuda:N, got 'gpu'.")
        for argv in (["convert", "SRC", "DST", "--groups", "1"], ["eval", "SRC", "--ppl-data", "x.txt"],
                     ["probe", "SRC", "--groups", "1", "--eval-data", "x.txt"], ["demo"],
                     ["recovery", "SRC", "--groups", "1"], ["replicate"])
    ],
    ("assets-GQAKIT_CACHE-is-a-file",
     lambda t, u: (["assets", "fetch", "wiki-en"], {"GQAKIT_CACHE": str(_file(t))}),
     "is a file, not a directory: point --cache-dir or GQAKIT_CACHE at a directory"),
    ("assets-cache-unwritable",
     lambda t, u: ["assets", "fetch", "wiki-en", "--cache-dir", str(u / "cache")],
     "cannot be written"),
    ("assets-fetch-an-asset-built-here",
     lambda t, u: ["assets", "fetch", "replicate-mha", "--cache-dir", str(t / "c")],
     "built on this machine by `gqakit replicate`"),
    ("assets-missing-wheelhouse",
     lambda t, u: ["assets", "fetch", "wiki-en", "--cache-dir", str(t / "c"), "--wheelhouse", str(t / "no")],
     "--wheelhouse"),
]  # fmt: skip


def _tiny(tmp_path: Path) -> Path:
    return save_tiny_model(tmp_path / "tiny", "llama", heads=4, kv_heads=4)


def _file(tmp_path: Path) -> Path:
    f = tmp_path / "a-file"
    f.write_text("x")
    return f


@pytest.mark.parametrize(("argv", "message"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_gives_one_clear_message(tmp_path, unwritable, argv, message):
    args = argv(tmp_path, unwritable)
    args, env = args if isinstance(args, tuple) else (args, {})
    res = CliRunner().invoke(main, args, env=env)
    assert res.exit_code != 0
    assert message in res.output, res.output
    assert "Traceback" not in res.output
