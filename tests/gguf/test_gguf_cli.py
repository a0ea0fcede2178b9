"""``gqakit export`` and ``gqakit inspect model.gguf`` from the command line."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from gguf_helpers import read_gguf

from gqakit.cli import main


def test_export_writes_a_gguf_and_refuses_to_overwrite(checkpoint, tmp_path):
    src = checkpoint("llama", "gqa")
    dst = tmp_path / "m.gguf"
    res = CliRunner().invoke(main, ["export", str(src), str(dst), "--type", "f32"])
    assert res.exit_code == 0, res.output
    assert "GGUF llama (f32)" in res.output and str(dst) in res.output
    _, infos, meta = read_gguf(dst)
    assert meta["llama.attention.head_count_kv"] == 2 and infos
    again = CliRunner().invoke(main, ["export", str(src), str(dst)])
    assert again.exit_code != 0 and "exists: pass --force" in again.output
    assert CliRunner().invoke(main, ["export", str(src), str(dst), "--force"]).exit_code == 0


def test_export_bad_input_leaves_nothing(tmp_path):
    res = CliRunner().invoke(main, ["export", str(tmp_path / "nope"), str(tmp_path / "m.gguf")])
    assert res.exit_code != 0 and "does not exist" in res.output
    assert not list(tmp_path.iterdir())


def test_inspect_reads_a_gguf_header(exported):
    _, result = exported("llama", "mqa")
    res = CliRunner().invoke(main, ["inspect", str(result.path)])
    assert res.exit_code == 0, res.output
    assert "K/V heads         1  (MQA)" in res.output and "gguf, 1 shard(s)" in res.output


def test_export_into_a_directory_it_cannot_write_is_refused_up_front(checkpoint, tmp_path):
    """No traceback from the temporary file: one message naming the directory and the fix, nothing left."""
    import os

    if os.geteuid() == 0:  # root writes anywhere a plain directory allows: sysfs refuses it
        ro = Path("/sys")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
    before = sorted(ro.iterdir())
    res = CliRunner().invoke(main, ["export", str(checkpoint("llama", "gqa")), str(ro / "sub" / "m.gguf")])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert f"Output directory {ro / 'sub'} cannot be written" in res.output, res.output
    assert "choose a path for m.gguf in a directory you can write to" in res.output
    assert sorted(ro.iterdir()) == before
