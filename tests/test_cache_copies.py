"""gqakit.cache_copies: when a copy's record says a newer copy supersedes it, and how a copy handed out
is held in use (the caches that use it, dequantized GGUF copies and llama.cpp's exports, are tested with
them, another process holding a copy among them)."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from gqakit import cache_copies
from gqakit.cache_copies import CopyKind, remove_superseded, superseded_by_record, use_file, write_record
from gqakit.errors import GqakitError

# sources that exist (a copy whose source is gone is an orphan); GONE does not
HERE, OTHER, GONE = str(Path(__file__).resolve()), str(Path(__file__).resolve().parent), "/no/such/models/m"
CURRENT = {"source": HERE, "fingerprint": "bbbb", "out_type": "f16", "v": 3}


@pytest.mark.parametrize(
    ("record", "superseded"),
    [
        ({**CURRENT, "fingerprint": "aaaa"}, True),  # the source changed since
        ({**CURRENT, "v": 2}, True),  # an older writer
        ({**CURRENT, "v": 2, "fingerprint": "aaaa"}, True),
        (CURRENT, False),  # the same copy (written again)
        ({**CURRENT, "fingerprint": "aaaa", "v": 4}, False),  # a newer writer's: left to it
        ({**CURRENT, "fingerprint": "aaaa", "source": OTHER}, False),  # another source
        ({**CURRENT, "source": GONE}, True),  # an orphan: its source is gone, whatever the other keys
        ({**CURRENT, "source": GONE, "out_type": "f32", "fingerprint": "aaaa"}, True),
        ({**CURRENT, "source": GONE, "v": 4}, False),  # a newer writer's orphan: left to it
        ({**CURRENT, "source": "relative/m"}, False),  # not an absolute path: not looked up
        ({**CURRENT, "fingerprint": "aaaa", "out_type": "f32"}, False),  # another key differs
        ({**CURRENT, "fingerprint": "aaaa", "v": "2"}, False),  # a version that is not a number
        ({k: v for k, v in CURRENT.items() if k != "v"}, False),  # no version
        (["not", "an", "object"], False),
        ({**CURRENT, "fingerprint": "aaaa", "host": "another-machine"}, False),  # a shared cache: its own
        ({**CURRENT, "source": GONE, "host": "another-machine"}, False),  # its path is that machine's
    ],
)
def test_a_record_supersedes_by_source_fingerprint_and_version(tmp_path, record, superseded):
    (tmp_path / "source.json").write_text(json.dumps(record))
    assert superseded_by_record(tmp_path / "source.json", CURRENT, "v", lambda: True) is superseded


def test_a_missing_record_asks_the_caches_rule_and_an_unreadable_one_keeps_its_copy(tmp_path):
    path = tmp_path / "source.json"
    assert superseded_by_record(path, CURRENT, "v", lambda: True) is True
    assert superseded_by_record(path, CURRENT, "v", lambda: False) is False
    path.write_text("{not json")
    assert superseded_by_record(path, CURRENT, "v", lambda: True) is False
    path.write_bytes(b"\xff\xfe")
    assert superseded_by_record(path, CURRENT, "v", lambda: True) is False
    write_record(tmp_path / "copy" / "source.json", CURRENT)  # its folder made as needed
    host = socket.gethostname()  # the machine that wrote it
    assert json.loads((tmp_path / "copy" / "source.json").read_text()) == {**CURRENT, "host": host}


def _copy(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _complete(copy: Path) -> bool:
    return (copy / "config.json").is_file()


def _kind(removed: list[Path]) -> CopyKind:
    def remove(copy: Path) -> int:
        removed.append(copy)
        shutil.rmtree(copy)
        return 0

    return CopyKind(("copy", "copies"), "a copy", logging.getLogger("test"), remove, lambda c: f"rm -rf {c}")


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_copy_is_held_once_per_process_and_let_go_when_its_source_has_a_newer_one(tmp_path):
    old = _copy(tmp_path / "cache" / "m-aaaa")
    assert cache_copies.in_use(lambda: old, _complete) == old
    fd = cache_copies._HELD[old]
    assert cache_copies.in_use(lambda: old, _complete) == old and cache_copies._HELD[old] == fd  # reused
    new = _copy(tmp_path / "cache" / "m-bbbb")
    removed: list[Path] = []
    # this process asks for the newer copy now: its own hold on the old one does not keep it
    assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [old] == removed
    assert old not in cache_copies._HELD and not use_file(old).exists()


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_reader_that_races_a_removal_takes_the_copy_written_anew(tmp_path):
    """The removal holds the copy's .use file while it removes the copy: a reader that opened that file
    waits, then finds it unlinked and the copy gone, and asks for the copy again (written anew)."""
    import fcntl

    copy = _copy(tmp_path / "cache" / "m-aaaa")
    asked: list[int] = []

    def get() -> Path:
        asked.append(1)
        if len(asked) > 1 and not _complete(copy):
            _copy(copy)  # written anew, as dequantized_gguf would
        return copy

    remover = os.open(use_file(copy), os.O_RDWR | os.O_CREAT)
    fcntl.flock(remover, fcntl.LOCK_EX)
    got: list[Path] = []
    reader = threading.Thread(target=lambda: got.append(cache_copies.in_use(get, _complete)))
    reader.start()
    time.sleep(0.5)  # the reader waits for the removal's lock
    assert asked == [1] and not got
    shutil.rmtree(copy)
    use_file(copy).unlink()
    os.close(remover)
    reader.join(timeout=10)
    assert got == [copy] and len(asked) == 2 and _complete(copy)
    # and it holds the new .use file: a removal now keeps the copy
    new = _copy(tmp_path / "cache" / "m-bbbb")
    fd = os.open(use_file(copy), os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    cache_copies.release(copy)
    assert remove_superseded(_kind([]), "m", new, lambda: [copy]) == [copy]


def test_a_copy_removed_each_time_it_is_handed_out_is_an_error(tmp_path):
    gone = tmp_path / "cache" / "m-aaaa"
    with pytest.raises(GqakitError, match="removed each time it was handed out"):
        cache_copies.in_use(lambda: gone, _complete)


def test_without_flock_nothing_is_removed(tmp_path, monkeypatch):
    """Windows has no shared locks to tell which copies other processes use: superseded ones are kept."""
    old = _copy(tmp_path / "cache" / "m-aaaa")
    new = _copy(tmp_path / "cache" / "m-bbbb")
    monkeypatch.setattr(cache_copies, "fcntl", None)
    removed: list[Path] = []
    assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [] == removed
    assert _complete(old)


def test_an_orphan_is_a_copy_whose_recorded_source_is_gone(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    record = tmp_path / "copy" / "source.json"
    write_record(record, {**CURRENT, "source": str(src)})
    assert not cache_copies.orphaned(record)
    src.rmdir()
    assert cache_copies.orphaned(record)
    write_record(record, {**CURRENT, "source": str(tmp_path / "afile" / "m")})  # a file where a folder was
    (tmp_path / "afile").write_text("")
    assert cache_copies.orphaned(record)
    record.write_text(json.dumps({**CURRENT, "source": str(src), "host": "another-machine"}))
    assert not cache_copies.orphaned(record)  # that machine's path: it may well exist there
    record.write_text("{not json")
    assert not cache_copies.orphaned(record) and not cache_copies.orphaned(tmp_path / "none.json")


def _recorded(path: Path, source: Path) -> Path:
    _copy(path)
    write_record(path / "source.json", {**CURRENT, "source": str(source)})
    return path


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_an_orphan_this_process_holds_is_kept_and_goes_once_let_go(tmp_path, caplog):
    """A copy superseded by its own source's newer one is let go by this process; an orphan it holds may
    still be opened by it (its source was deleted, not replaced): kept."""
    src = tmp_path / "src"
    src.mkdir()
    orphan = _recorded(tmp_path / "cache" / "m-aaaa", src)
    new = _copy(tmp_path / "cache" / "n-bbbb")
    assert cache_copies.in_use(lambda: orphan, _complete) == orphan
    src.rmdir()
    removed: list[Path] = []
    kind = dataclasses.replace(_kind(removed), record=lambda c: c / "source.json")
    caplog.set_level(logging.INFO, logger="test")
    assert remove_superseded(kind, "n", new, lambda: [orphan]) == [] == removed
    assert _complete(orphan) and "in use by this process" in caplog.text
    cache_copies.release(orphan)  # as when the process that held it has exited
    assert remove_superseded(kind, "n", new, lambda: [orphan]) == [orphan] == removed


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_reader_that_finds_its_copy_removed_leaves_no_use_file_for_it(tmp_path):
    """A removal that takes the copy between get and the hold: the reader asks again (another copy, the
    source having changed) and leaves no .use file for the copy that is gone."""
    import fcntl

    old = _copy(tmp_path / "cache" / "m-aaaa")
    new = _copy(tmp_path / "cache" / "m-bbbb")
    # the removal runs just before the reader opens the .use file (it creates the file anew)
    calls: list[Path] = []

    def complete(copy: Path) -> bool:
        calls.append(copy)
        ok = _complete(copy)
        if len(calls) == 1:
            cache_copies._remove_unused(_kind([]), copy)
        return ok

    got = cache_copies.in_use(lambda: new if calls else old, complete)
    assert got == new and not old.exists() and not use_file(old).exists()
    # the removal runs while the reader waits on the .use file: it finds it unlinked, the copy gone
    older = _copy(tmp_path / "cache" / "m-0000")
    remover = os.open(use_file(older), os.O_RDWR | os.O_CREAT)
    fcntl.flock(remover, fcntl.LOCK_EX)
    asked: list[int] = []

    def get() -> Path:
        asked.append(1)
        return older if len(asked) == 1 else new

    reader = threading.Thread(target=lambda: cache_copies.in_use(get, _complete))
    reader.start()
    time.sleep(0.5)
    shutil.rmtree(older)
    use_file(older).unlink()
    os.close(remover)
    reader.join(timeout=10)
    assert len(asked) == 2 and not use_file(older).exists()


def _no_flock(code: int, only_use: bool = False):
    """``fcntl.flock`` on a filesystem where it fails with ``code``; ``only_use``: only on .use files."""
    import fcntl

    real = fcntl.flock

    def flock(fd, op):
        if only_use and not os.readlink(f"/proc/self/fd/{fd}").endswith(".use"):
            return real(fd, op)
        raise OSError(code, os.strerror(code))

    return flock


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
@pytest.mark.parametrize(
    "code", sorted({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
)
def test_where_flock_fails_copies_are_handed_out_unheld_and_none_is_removed(
    tmp_path, monkeypatch, caplog, code
):
    """A filesystem without working flock (NFS without lockd, some FUSE): as on Windows, not a crash."""
    old = _copy(tmp_path / "cache" / "m-aaaa")
    new = _copy(tmp_path / "cache" / "m-bbbb")
    monkeypatch.setattr(cache_copies, "_NO_FLOCK", False)
    monkeypatch.setattr(cache_copies, "_HELD", {})
    monkeypatch.setattr(cache_copies.fcntl, "flock", _no_flock(code))
    caplog.set_level(logging.DEBUG)
    assert cache_copies.in_use(lambda: new, _complete) == new and new not in cache_copies._HELD
    assert cache_copies.in_use(lambda: old, _complete) == old
    assert caplog.text.count("flock fails here") == 1
    removed: list[Path] = []
    assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [] == removed and _complete(old)
    # the removal's own locks fail so too (its writer's .lock, or only the .use file): the copy is kept,
    # and no warning asks for an rm -rf
    for only_use in (False, True):
        if only_use and not Path("/proc/self/fd").is_dir():
            continue
        monkeypatch.setattr(cache_copies, "_NO_FLOCK", False)
        monkeypatch.setattr(cache_copies.fcntl, "flock", _no_flock(code, only_use))
        assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [] == removed and _complete(old)
        assert cache_copies._NO_FLOCK and "could not remove" not in caplog.text
    assert "WARNING" not in caplog.text
