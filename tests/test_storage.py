"""gqakit.storage, gqakit.locks and gqakit.cached_copies: atomic files and output directories, the
locks, and the cached copies.

A second process is refused a working directory with the first's pid and command, and a killed holder
leaves nothing that blocks the next run. A cached copy's record says when a newer copy supersedes it, and a
copy handed out is held in use (the caches that use it, dequantized GGUF copies and llama.cpp's exports,
are tested with them, another process holding a copy among them).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gqakit import cached_copies, locks
from gqakit.cached_copies import (
    CopyKind,
    remove_superseded,
    superseded_by_record,
    use_file,
    write_record,
)
from gqakit.errors import GqakitError
from gqakit.locks import exclusive, working_directory
from gqakit.storage import (
    OWNER_FILE,
    atomic_output_dir,
    atomic_write,
    write_json,
)

NO_SIGKILL = pytest.mark.skipif(sys.platform == "win32", reason="the holder is killed with SIGKILL")


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, {"step": 1})
    with pytest.raises(KeyboardInterrupt), atomic_write(path) as tmp:
        tmp.write_text('{"step": ')  # half written when the run is stopped
        raise KeyboardInterrupt
    assert json.loads(path.read_text()) == {"step": 1} and [p.name for p in tmp_path.iterdir()] == [path.name]
    write_json(path, {"step": 2})
    mask = os.umask(0)
    os.umask(mask)
    assert json.loads(path.read_text()) == {"step": 2}
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # as any new file, not the temporary's 0600


def test_a_killed_runs_partial_output_is_removed_by_the_next_run(tmp_path):
    dst = tmp_path / "out"
    dead = tmp_path / ".out.abc123.partial"  # what kill -9 left: its owner process no longer exists
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 1000)
    (dead / OWNER_FILE).write_text(f"{os.uname().nodename} 999999999\n")
    unknown = tmp_path / ".out.def456.partial"  # left by something that did not say who it was
    unknown.mkdir()
    other = tmp_path / ".other.aaa.partial"  # another DST's: none of this run's business
    other.mkdir()
    with atomic_output_dir(dst) as tmp:
        (tmp / "f").write_text("ok")
        assert tmp.exists()
    assert not dead.exists() and unknown.exists() and other.exists()
    assert (dst / "f").read_text() == "ok" and not (dst / OWNER_FILE).exists()


def _holder(work) -> subprocess.Popen:
    """Another process that holds ``work`` until it is killed; returns once it holds it."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from gqakit.locks import working_directory
        with working_directory({str(work)!r}):
            print("held", flush=True)
            time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code, "--tag"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@NO_SIGKILL
def test_a_second_run_is_refused_with_the_holders_pid_and_runs_once_it_is_killed(tmp_path):
    work = tmp_path / "work"
    proc = _holder(work)
    try:
        with pytest.raises(GqakitError) as err:
            with working_directory(work):
                pytest.fail("entered a working directory another process holds")
        msg = err.value.message
        assert f"--work-dir {work} is in use by another run (pid {proc.pid} " in msg
        assert "--tag" in msg  # the holder's command line
        assert "pass another --work-dir" in msg
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: the OS drops the lock
        proc.wait()
    with working_directory(work) as held:
        assert held == work.resolve() and (work / ".gqakit-lock").exists()
    assert not (work / ".gqakit-lock").exists()  # released: nothing left in the working directory


def test_the_lock_is_released_on_an_error_and_taken_again_in_the_same_process(tmp_path):
    lock = tmp_path / ".lock"
    with pytest.raises(RuntimeError):
        with exclusive(lock, "busy"):
            raise RuntimeError("the run failed")
    assert not lock.exists()
    with exclusive(lock, "busy"):
        with pytest.raises(GqakitError, match=r"^held by pid \d+ on "):
            with exclusive(lock, "held by {owner}"):  # another open of the file is another holder
                pass


def test_a_working_directory_that_cannot_be_created_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(GqakitError, match=r"--work-dir .*file/w cannot be created"):
        with working_directory(blocker / "w"):
            pass


def test_a_working_directory_that_cannot_be_written_is_named(tmp_path, monkeypatch):

    def read_only(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(locks.os, "open", read_only)  # as in a directory this user cannot write
    message = r"--work-dir .*w cannot be created or written \(Permission denied\)"
    with pytest.raises(GqakitError, match=message):
        with working_directory(tmp_path / "w"):
            pass


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def test_where_flock_does_not_work_the_block_runs_unguarded_with_a_warning(
    tmp_path, monkeypatch, caplog, code
):
    """NFS without a lock service answers flock with ENOLCK: a command must still run there (it did
    before gqakit locked anything), saying that it is unguarded."""
    import errno
    import logging

    def no_flock(fd, op):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(locks.fcntl, "flock", no_flock)
    caplog.set_level(logging.WARNING, logger="gqakit.locks")
    ran = []
    with exclusive(tmp_path / ".w.lock", "in use ({owner})"):
        ran.append("exclusive")
    with locks.one_at_a_time(tmp_path / ".a.lock", lambda owner: None):
        ran.append("one_at_a_time")
    assert ran == ["exclusive", "one_at_a_time"]
    assert caplog.text.count("has no working flock); going on without the lock") == 2
    assert not list(tmp_path.iterdir())  # the lock files are removed as usual
    monkeypatch.setattr(locks.fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.EIO, "io")))
    with pytest.raises(OSError, match="io"), exclusive(tmp_path / ".w.lock", "in use ({owner})"):
        pass  # any other error still stops the command


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
    assert cached_copies.in_use(lambda: old, _complete) == old
    fd = cached_copies._HELD[old]
    assert cached_copies.in_use(lambda: old, _complete) == old and cached_copies._HELD[old] == fd  # reused
    new = _copy(tmp_path / "cache" / "m-bbbb")
    removed: list[Path] = []
    # this process asks for the newer copy now: its own hold on the old one does not keep it
    assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [old] == removed
    assert old not in cached_copies._HELD and not use_file(old).exists()


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
    reader = threading.Thread(target=lambda: got.append(cached_copies.in_use(get, _complete)))
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
    cached_copies.release(copy)
    assert remove_superseded(_kind([]), "m", new, lambda: [copy]) == [copy]


def test_a_copy_removed_each_time_it_is_handed_out_is_an_error(tmp_path):
    gone = tmp_path / "cache" / "m-aaaa"
    with pytest.raises(GqakitError, match="removed each time it was handed out"):
        cached_copies.in_use(lambda: gone, _complete)


def test_without_flock_nothing_is_removed(tmp_path, monkeypatch):
    """Windows has no shared locks to tell which copies other processes use: superseded ones are kept."""
    old = _copy(tmp_path / "cache" / "m-aaaa")
    new = _copy(tmp_path / "cache" / "m-bbbb")
    monkeypatch.setattr(cached_copies, "fcntl", None)
    removed: list[Path] = []
    assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [] == removed
    assert _complete(old)


def test_an_orphan_is_a_copy_whose_recorded_source_is_gone(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    record = tmp_path / "copy" / "source.json"
    write_record(record, {**CURRENT, "source": str(src)})
    assert not cached_copies.orphaned(record)
    src.rmdir()
    assert cached_copies.orphaned(record)
    write_record(record, {**CURRENT, "source": str(tmp_path / "afile" / "m")})  # a file where a folder was
    (tmp_path / "afile").write_text("")
    assert cached_copies.orphaned(record)
    record.write_text(json.dumps({**CURRENT, "source": str(src), "host": "another-machine"}))
    assert not cached_copies.orphaned(record)  # that machine's path: it may well exist there
    record.write_text("{not json")
    assert not cached_copies.orphaned(record) and not cached_copies.orphaned(tmp_path / "none.json")


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
    assert cached_copies.in_use(lambda: orphan, _complete) == orphan
    src.rmdir()
    removed: list[Path] = []
    kind = dataclasses.replace(_kind(removed), record=lambda c: c / "source.json")
    caplog.set_level(logging.INFO, logger="test")
    assert remove_superseded(kind, "n", new, lambda: [orphan]) == [] == removed
    assert _complete(orphan) and "in use by this process" in caplog.text
    cached_copies.release(orphan)  # as when the process that held it has exited
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
            cached_copies._remove_unused(_kind([]), copy)
        return ok

    got = cached_copies.in_use(lambda: new if calls else old, complete)
    assert got == new and not old.exists() and not use_file(old).exists()
    # the removal runs while the reader waits on the .use file: it finds it unlinked, the copy gone
    older = _copy(tmp_path / "cache" / "m-0000")
    remover = os.open(use_file(older), os.O_RDWR | os.O_CREAT)
    fcntl.flock(remover, fcntl.LOCK_EX)
    asked: list[int] = []

    def get() -> Path:
        asked.append(1)
        return older if len(asked) == 1 else new

    reader = threading.Thread(target=lambda: cached_copies.in_use(get, _complete))
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
    monkeypatch.setattr(cached_copies, "_NO_FLOCK", False)
    monkeypatch.setattr(cached_copies, "_HELD", {})
    monkeypatch.setattr(cached_copies.fcntl, "flock", _no_flock(code))
    caplog.set_level(logging.DEBUG)
    assert cached_copies.in_use(lambda: new, _complete) == new and new not in cached_copies._HELD
    assert cached_copies.in_use(lambda: old, _complete) == old
    assert caplog.text.count("flock fails here") == 1
    removed: list[Path] = []
    assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [] == removed and _complete(old)
    # the removal's own locks fail so too (its writer's .lock, or only the .use file): the copy is kept,
    # and no warning asks for an rm -rf
    for only_use in (False, True):
        if only_use and not Path("/proc/self/fd").is_dir():
            continue
        monkeypatch.setattr(cached_copies, "_NO_FLOCK", False)
        monkeypatch.setattr(cached_copies.fcntl, "flock", _no_flock(code, only_use))
        assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [] == removed and _complete(old)
        assert cached_copies._NO_FLOCK and "could not remove" not in caplog.text
    assert "WARNING" not in caplog.text
