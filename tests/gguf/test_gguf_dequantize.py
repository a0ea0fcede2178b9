"""A GGUF source is dequantized once, into the cache, and every command that reads it opens that copy."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import gqakit.gguf.dequantize as deq
from gqakit import locks, storage
from gqakit.convert.api import ConvertOptions, convert_checkpoint, inspect_checkpoint
from gqakit.errors import GqakitError
from gqakit.gguf.export import export_gguf
from gqakit.locks import one_at_a_time
from gqakit.storage import atomic_output_dir, cache_root, fingerprint, source_folder


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


def _copy_name(path: Path) -> str:
    return f"{path.stem}-{fingerprint(path)}-r{deq.READER_VERSION}"


def test_a_second_conversion_of_a_gguf_reuses_its_dequantized_copy(exported, tmp_path, counted):
    _, mha = exported("llama", "mha", "f32")
    first = convert_checkpoint(mha.path, tmp_path / "one", ConvertOptions(groups=2))
    assert counted == [mha.path]
    second = convert_checkpoint(mha.path, tmp_path / "two", ConvertOptions(groups=1))
    assert counted == [mha.path]  # the second conversion dequantized nothing
    cached = sorted((tmp_path / "cache" / deq.CACHE).glob("*/*"))
    assert len(cached) == 1  # one copy, and no lock left beside it
    assert (cached[0] / "config.json").is_file()
    assert first.to_kv_heads == 2 and second.to_kv_heads == 1
    # the other commands that read a .gguf open the same copy
    assert deq.dequantized_gguf(mha.path) == cached[0]
    export_gguf(mha.path, tmp_path / "again.gguf", "f32")
    assert inspect_checkpoint(str(mha.path)).num_kv_heads == 4
    assert counted == [mha.path]


def _copy_of(src: Path, dst: Path, later_s: int = 0) -> Path:
    """``src`` copied to ``dst``, its modification time ``later_s`` seconds after the copy's."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    _touch(dst, later_s)
    return dst


def _touch(path: Path, later_s: int = 1) -> None:
    """``path`` rewritten, as far as its fingerprint tells: the same bytes, a later modification time."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + later_s * 10**9))


def _copies() -> list[str]:
    """The names of the copies in the cache (not the hidden lock files and temporary folders)."""
    return sorted(p.name for p in (cache_root() / deq.CACHE).glob("*/*") if not p.name.startswith("."))


def test_a_changed_gguf_is_dequantized_again(exported, tmp_path, counted):
    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    a = deq.dequantized_gguf(gguf)
    wa = load_file(a / "model.safetensors")
    _touch(gguf)  # rewritten: a new fingerprint
    b = deq.dequantized_gguf(gguf)
    assert a != b and len(counted) == 2
    wb = load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_the_copy_of_a_gguf_before_it_changed_is_removed(exported, tmp_path, counted, caplog, monkeypatch):
    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    old = deq.dequantized_gguf(gguf)
    _touch(gguf)
    caplog.set_level(logging.INFO, logger="gqakit.gguf.dequantize")
    new = deq.dequantized_gguf(gguf)
    assert _copies() == [new.name] and not old.exists()  # one copy for the file: the new one
    assert f"removed {old} (" in caplog.text and " MiB)" in caplog.text
    # a later reader's copy of the same file replaces this reader's
    monkeypatch.setattr(deq, "READER_VERSION", deq.READER_VERSION + 1)
    newer = deq.dequantized_gguf(gguf)
    assert newer.name.endswith("-r4") and _copies() == [newer.name] and len(counted) == 3
    # no lock or temporary folder left
    assert [p.name for p in (cache_root() / deq.CACHE).glob("*/.*")] == []


def test_the_copy_of_another_gguf_with_the_same_name_is_kept(exported, tmp_path, counted):
    _, mha = exported("llama", "mha", "f32")
    here = _copy_of(mha.path, tmp_path / "a" / "model.gguf")
    there = _copy_of(mha.path, tmp_path / "b" / "model.gguf", later_s=5)
    theirs = deq.dequantized_gguf(there)
    first = deq.dequantized_gguf(here)
    _touch(here)
    mine = deq.dequantized_gguf(here)
    assert _copies() == sorted([theirs.name, mine.name]) and not first.exists()
    assert deq.dequantized_gguf(there) == theirs and len(counted) == 3  # still cached


def test_a_copy_being_written_is_kept(exported, tmp_path, counted):
    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    old = deq.dequantized_gguf(gguf)
    writing = old.with_name(f".{old.name}.partial")  # as atomic_output_dir writes one
    writing.mkdir()
    _touch(gguf)
    new = deq.dequantized_gguf(gguf)
    assert _copies() == [new.name] and writing.is_dir()


def test_a_copy_that_cannot_be_removed_is_reported_and_the_command_goes_on(
    exported, tmp_path, counted, caplog, monkeypatch
):
    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    old = deq.dequantized_gguf(gguf)
    _touch(gguf)

    real = storage.shutil.rmtree

    def refuse(path, *args, **kwargs):
        if Path(path).name != f".removing-{old.name}":
            return real(path, *args, **kwargs)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(storage.shutil, "rmtree", refuse)
    caplog.set_level(logging.WARNING, logger="gqakit.gguf.dequantize")
    new = deq.dequantized_gguf(gguf)
    assert (new / "config.json").is_file()
    assert f"could not remove {old}" in caplog.text and f"rm -rf {old.parent}/.removing-" in caplog.text
    assert not (old / "config.json").exists()  # what is left of it is never opened as a copy


def test_a_command_while_another_dequantizes_the_same_gguf_waits_and_reuses_its_copy(
    exported, tmp_path, counted, caplog
):
    _, mha = exported("llama", "mha", "f32")
    out = source_folder(deq.CACHE, mha.path.resolve()) / _copy_name(mha.path)
    out.parent.mkdir(parents=True)
    caplog.set_level(logging.WARNING, logger="gqakit.gguf.dequantize")
    got: list[Path] = []
    waiter = threading.Thread(target=lambda: got.append(deq.dequantized_gguf(mha.path)))
    with one_at_a_time(out.parent / ".lock", lambda owner: None):  # a first command's copy
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


def test_the_suite_dequantizes_into_a_cache_of_its_own(session_cache):
    """tests/conftest.py: no test leaves a dequantized copy in the user's cache."""
    assert cache_root() == session_cache.resolve() != (Path.home() / ".cache" / "gqakit").resolve()


@pytest.mark.real_cache
def test_a_test_marked_real_cache_sees_the_users_cache(session_cache):
    assert cache_root() != session_cache.resolve()


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_cached_copy_is_handed_out_where_flock_fails(exported, tmp_path, counted, monkeypatch):
    import errno

    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    copy = deq.dequantized_gguf(gguf)

    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(locks.fcntl, "flock", flock)
    assert deq.dequantized_gguf(gguf) == copy and len(counted) == 1
    _touch(gguf)  # dequantized again, and the old copy removed, without the locks
    assert deq.dequantized_gguf(gguf) != copy and len(counted) == 2 and _copies() == [_copy_name(gguf)]
