"""A GGUF source is dequantized once, into the cache, and every command that reads it opens that copy."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import gqakit.gguf.dequantize as deq
from gqakit.convert.api import ConvertOptions, convert_checkpoint, inspect_checkpoint
from gqakit.errors import GqakitError
from gqakit.gguf.export import export_gguf
from gqakit.locks import one_at_a_time
from gqakit.storage import atomic_output_dir


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
    cached = sorted((tmp_path / "cache" / deq.CACHE).iterdir())
    # one copy, and beside it the file whose lock holds it in use while this process runs
    assert [p.name for p in cached] == [f".{cached[1].name}.use", cached[1].name]
    cached = cached[1:]
    assert (cached[0] / "config.json").is_file()
    assert first.to_kv_heads == 2 and second.to_kv_heads == 1
    assert not (first.dst / ".gqakit").exists()  # the copy's record of its source is not the model's
    # the other commands that read a .gguf open the same copy
    assert deq.local_model(str(mha.path)) == str(cached[0])
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
    return sorted(p.name for p in (deq.cache_root() / deq.CACHE).iterdir() if not p.name.startswith("."))


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
    record = json.loads((new / deq.SOURCE_RECORD).read_text())
    host = socket.gethostname()
    assert record == {
        "source": str(gguf.resolve()),
        "fingerprint": deq.fingerprint(gguf),
        "reader": 3,
        "host": host,
    }
    # a later reader's copy of the same file replaces this reader's
    monkeypatch.setattr(deq, "READER_VERSION", deq.READER_VERSION + 1)
    newer = deq.dequantized_gguf(gguf)
    assert newer.name.endswith("-r4") and _copies() == [newer.name] and len(counted) == 3
    # no lock or temporary folder left: only the file that holds the copy in use while this process runs
    assert [p.name for p in (deq.cache_root() / deq.CACHE).glob(".*")] == [f".{newer.name}.use"]


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


def test_copies_an_older_gqakit_wrote_are_removed_by_the_files_name(exported, tmp_path, counted):
    """Copies without a record are older readers' (every copy since has one): those named for the file's
    stem go once the file has a current copy, even another directory's file of that name (no command of
    this gqakit would open them). Another stem's, or one named for this reader, are kept."""
    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    cache = deq.cache_root() / deq.CACHE
    fp = deq.fingerprint(gguf)
    legacy = ["model-0123456789abcdef", f"model-{fp}", f"model-{fp}-r2"]  # before reader 2, reader 2
    kept = ["model-q4-0123456789abcdef-r2", "other-0123456789abcdef", f"model-{fp}-r9", "model-notacopy"]
    for name in legacy + kept:
        (cache / name).mkdir(parents=True)
        (cache / name / "config.json").write_text("{}")
    new = deq.dequantized_gguf(gguf)
    assert _copies() == sorted([*kept, new.name])


def test_a_superseded_copy_another_process_is_writing_is_kept(exported, tmp_path, counted, caplog):
    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    old = deq.dequantized_gguf(gguf)
    _touch(gguf)
    caplog.set_level(logging.INFO, logger="gqakit.gguf.dequantize")
    with one_at_a_time(old.parent / f".{old.name}.lock", lambda owner: None):  # another process's
        new = deq.dequantized_gguf(gguf)
    assert _copies() == sorted([old.name, new.name]) and (old / "config.json").is_file()
    assert f"kept {old}" in caplog.text and "removed" not in caplog.text
    _touch(gguf)  # the next copy removes both
    newest = deq.dequantized_gguf(gguf)
    assert _copies() == [newest.name]


def test_a_copy_that_cannot_be_removed_is_reported_and_the_command_goes_on(
    exported, tmp_path, counted, caplog, monkeypatch
):
    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    old = deq.dequantized_gguf(gguf)
    _touch(gguf)

    real = deq.shutil.rmtree

    def refuse(path, *args, **kwargs):
        if Path(path) != old:
            return real(path, *args, **kwargs)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(deq.shutil, "rmtree", refuse)
    caplog.set_level(logging.WARNING, logger="gqakit.gguf.dequantize")
    new = deq.dequantized_gguf(gguf)
    assert (new / "config.json").is_file()
    assert f"could not remove {old}" in caplog.text and f"rm -rf {old}" in caplog.text
    assert not (old / "config.json").exists()  # what is left of it is never opened as a copy


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


def test_the_suite_dequantizes_into_a_cache_of_its_own(session_cache):
    """tests/conftest.py: no test leaves a dequantized copy in the user's cache."""
    assert deq.cache_root() == session_cache.resolve() != (Path.home() / ".cache" / "gqakit").resolve()


@pytest.mark.real_cache
def test_a_test_marked_real_cache_sees_the_users_cache(session_cache):
    assert deq.cache_root() != session_cache.resolve()


def _reader(code: str) -> subprocess.Popen:
    """Another process that runs ``code`` (which prints the copy it got) and then keeps running, holding
    that copy in use as a command that opens it later would; returns once it holds it."""
    script = f"{textwrap.dedent(code)}\nimport time\ntime.sleep(600)\n"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    if not proc.stdout.readline().strip():
        proc.kill()
        pytest.fail("the reader process did not get its copy")
    return proc


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: nothing is removed there")
def test_a_superseded_copy_another_process_still_uses_is_kept_until_it_exits(
    exported, tmp_path, counted, caplog
):
    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    old = deq.dequantized_gguf(gguf)
    # eval dequantizes each model first and opens it later; meanwhile the .gguf is downloaded again
    proc = _reader(
        f"from gqakit.gguf.dequantize import dequantized_gguf\nprint(dequantized_gguf({str(gguf)!r}))"
    )
    try:
        _touch(gguf)
        caplog.set_level(logging.INFO, logger="gqakit.gguf.dequantize")
        new = deq.dequantized_gguf(gguf)
        assert _copies() == sorted([old.name, new.name]) and (old / "config.json").is_file()
        assert f"kept {old}, a superseded copy of model.gguf: it is in use by another process" in caplog.text
        assert "removed" not in caplog.text
    finally:
        proc.kill()
        proc.wait()
    # once it has exited, nothing holds the old copy
    assert deq.remove_superseded(gguf.resolve(), new) == [old]
    assert _copies() == [new.name] and not deq.cached_copies.use_file(old).exists()


def _held_elsewhere(copy: Path) -> int:
    """A shared lock on ``copy``'s .use file as another process's hold takes it (its own open file, which
    this process's removal cannot lock exclusively); close the descriptor to let go."""
    import fcntl

    fd = os.open(deq.cached_copies.use_file(copy), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: nothing is removed there")
def test_a_copy_kept_while_in_use_is_removed_when_the_current_one_is_reused(exported, tmp_path, counted):
    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    old = deq.dequantized_gguf(gguf)
    fd = _held_elsewhere(old)
    _touch(gguf)
    new = deq.dequantized_gguf(gguf)
    assert _copies() == sorted([old.name, new.name])  # in use: kept
    assert deq.dequantized_gguf(gguf) == new and _copies() == sorted([old.name, new.name])  # still
    os.close(fd)  # the other process exits
    assert deq.dequantized_gguf(gguf) == new and _copies() == [new.name] and len(counted) == 2


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: nothing is removed there")
def test_the_copy_of_a_deleted_gguf_is_removed_once_nothing_holds_it(exported, tmp_path, counted, caplog):
    _, mha = exported("llama", "mha", "f32")
    gone = _copy_of(mha.path, tmp_path / "a" / "gone.gguf")
    kept = _copy_of(mha.path, tmp_path / "b" / "kept.gguf")
    orphan, current = deq.dequantized_gguf(gone), deq.dequantized_gguf(kept)
    gone.unlink()
    caplog.set_level(logging.INFO, logger="gqakit.gguf.dequantize")
    assert deq.dequantized_gguf(kept) == current and (orphan / "config.json").is_file()  # this process's
    assert "in use by this process" in caplog.text
    deq.cached_copies.release(orphan)  # as when the command that got it has exited
    assert deq.dequantized_gguf(kept) == current and _copies() == [current.name]
    assert f"removed {orphan} (" in caplog.text and "a dequantized copy whose source is gone" in caplog.text


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_cached_copy_is_handed_out_where_flock_fails(exported, tmp_path, counted, monkeypatch):
    import errno

    _, mha = exported("llama", "mha", "f32")
    gguf = _copy_of(mha.path, tmp_path / "model.gguf")
    copy = deq.dequantized_gguf(gguf)
    monkeypatch.setattr(deq.cached_copies, "_NO_FLOCK", False)
    monkeypatch.setattr(deq.cached_copies, "_HELD", {})  # a fresh process

    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(deq.cached_copies.fcntl, "flock", flock)
    assert deq.dequantized_gguf(gguf) == copy and len(counted) == 1
