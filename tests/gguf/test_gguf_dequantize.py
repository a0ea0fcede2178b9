"""A GGUF source is dequantized once, into the cache, and every command that reads it opens that copy."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from gqakit.convert.api import ConvertOptions, convert_checkpoint, inspect_checkpoint
from gqakit.errors import GqakitError
from gqakit.gguf import dequantize as deq
from gqakit.gguf import export_gguf
from gqakit.locks import one_at_a_time
from gqakit.outputs import atomic_output_dir


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The GGUF dequantizations done while the test runs, into a cache of its own."""
    monkeypatch.setenv("GQAKIT_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    real = deq.dequantize_gguf

    def counting(gguf_path, out_dir, dtype=None):
        calls.append(Path(gguf_path))
        return real(gguf_path, out_dir, dtype)

    monkeypatch.setattr(deq, "dequantize_gguf", counting)
    return calls


def test_a_second_conversion_of_a_gguf_reuses_its_dequantized_copy(exported, tmp_path, counted):
    _, mha = exported("llama", "mha", "f32")
    first = convert_checkpoint(mha.path, tmp_path / "one", ConvertOptions(groups=2))
    assert counted == [mha.path]
    second = convert_checkpoint(mha.path, tmp_path / "two", ConvertOptions(groups=1))
    assert counted == [mha.path]  # the second conversion dequantized nothing
    cached = list((tmp_path / "cache" / deq.CACHE).iterdir())
    assert len(cached) == 1 and (cached[0] / "config.json").is_file()
    assert first.to_kv_heads == 2 and second.to_kv_heads == 1
    # the other commands that read a .gguf open the same copy
    assert deq.local_model(str(mha.path)) == str(cached[0])
    export_gguf(mha.path, tmp_path / "again.gguf", "f32")
    assert inspect_checkpoint(str(mha.path)).num_kv_heads == 4
    assert counted == [mha.path]


def test_a_changed_gguf_is_dequantized_again(exported, tmp_path, counted):
    _, mha = exported("llama", "mha", "f32")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(mha.path.read_bytes())
    a = deq.dequantized_gguf(gguf)
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten: a new fingerprint
    b = deq.dequantized_gguf(gguf)
    assert a != b and len(counted) == 2
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_a_command_while_another_dequantizes_the_same_gguf_waits_and_reuses_its_copy(
    exported, tmp_path, counted, caplog
):
    _, mha = exported("llama", "mha", "f32")
    out = deq.cache_root() / deq.CACHE / deq.cache_name(mha.path)
    out.parent.mkdir(parents=True)
    caplog.set_level(logging.WARNING, logger="gqakit.gguf.dequantize")
    got: list[Path] = []
    waiter = threading.Thread(target=lambda: got.append(deq.dequantized_gguf(mha.path)))
    with one_at_a_time(out.parent / f".{out.name}.lock", lambda owner: None):  # a first command's copy
        waiter.start()
        for _ in range(300):
            if "waiting for pid" in caplog.text:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the second command did not wait for the dequantization under way")
        assert counted == []
        with atomic_output_dir(out, force=True) as tmp:
            deq.dequantize_gguf(mha.path, tmp)
    waiter.join(timeout=60)
    assert got == [out] and counted == [mha.path]  # dequantized once, by the first


def test_an_output_containing_the_gguf_is_refused_before_force_could_delete_it(exported, tmp_path, counted):
    _, mha = exported("llama", "mha", "f32")
    models = tmp_path / "models"
    models.mkdir()
    gguf = models / "model.gguf"
    gguf.write_bytes(mha.path.read_bytes())
    with pytest.raises(GqakitError, match=r"Output .*models contains the source .*model\.gguf"):
        convert_checkpoint(gguf, models, ConvertOptions(groups=2, force=True))
    assert [p.name for p in models.iterdir()] == ["model.gguf"]
