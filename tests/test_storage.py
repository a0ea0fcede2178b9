"""gqakit.storage and gqakit.locks: atomic files and output directories, the locks, and the cached
copies.

A second process is refused a working directory with the first's pid and command, and a killed holder
leaves nothing that blocks the next run. The caches of copies (dequantized GGUF copies and llama.cpp's
exports) are tested with their users.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gqakit import locks, storage
from gqakit.errors import GqakitError
from gqakit.locks import exclusive
from gqakit.storage import atomic_output_dir, atomic_write, working_directory, write_json

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
    dead = tmp_path / ".out.partial"  # what kill -9 left: no run holds DST's lock
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 1000)
    unknown = tmp_path / ".out.def456.partial"  # not a name gqakit writes: left alone
    unknown.mkdir()
    other = tmp_path / ".other.partial"  # another DST's: none of this run's business
    other.mkdir()
    with atomic_output_dir(dst) as tmp:
        (tmp / "f").write_text("ok")
        assert tmp == dead and not (tmp / "model.safetensors").exists()
    assert not dead.exists() and unknown.exists() and other.exists()
    assert (dst / "f").read_text() == "ok" and not (tmp_path / ".out.partial.lock").exists()
    with atomic_output_dir(dst, force=True) as tmp:
        (tmp / "g").write_text("new")
    assert [p.name for p in dst.iterdir()] == ["g"] and not (tmp_path / ".out.old").exists()


def test_a_second_command_writing_the_same_output_is_refused(tmp_path):
    dst = tmp_path / "out"
    with atomic_output_dir(dst) as tmp:
        (tmp / "f").write_text("first")
        with pytest.raises(GqakitError, match=r"Output .*out is being written by another command \(pid "):
            with atomic_output_dir(dst, force=True):
                pytest.fail("wrote an output another command is writing")
    assert (dst / "f").read_text() == "first"


def _holder(work) -> subprocess.Popen:
    """Another process that holds ``work`` until it is killed; returns once it holds it."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from gqakit.storage import working_directory
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
    with pytest.raises(GqakitError, match=r"--work-dir .*file/w cannot be written"):
        with working_directory(blocker / "w"):
            pass


def test_a_working_directory_that_cannot_be_written_is_named(tmp_path, monkeypatch):

    def read_only(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(locks.os, "open", read_only)  # as in a directory this user cannot write
    message = r"--work-dir .*w cannot be written \(Permission denied\)"
    with pytest.raises(GqakitError, match=message):
        with working_directory(tmp_path / "w"):
            pass


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def test_where_flock_does_not_work_the_block_runs_unguarded_with_a_warning(
    tmp_path, monkeypatch, caplog, code
):
    """NFS without a lock service answers flock with ENOLCK: a command must still run there (it did
    before gqakit locked anything), saying that it is unguarded."""

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


def test_each_source_machine_and_key_has_a_folder_of_copies_of_its_own(monkeypatch):
    a, b = Path("/models/a/m.gguf"), Path("/models/b/m.gguf")
    here = storage.source_folder("x", a, "f16")
    assert here.name.startswith("m.gguf-") and here == storage.source_folder("x", a, "f16")
    assert here != storage.source_folder("x", b, "f16") != storage.source_folder("x", a, "f32")
    monkeypatch.setattr(storage.socket, "gethostname", lambda: "another-machine")  # a shared cache
    assert storage.source_folder("x", a, "f16") != here
