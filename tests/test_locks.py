"""One process at a time in a working directory: a second is refused with the first's pid and command,
and a killed holder leaves nothing that blocks the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from gqakit.errors import GqakitError
from gqakit.locks import exclusive, working_directory

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the holder is killed with SIGKILL")


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
    import gqakit.locks as locks

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

    import gqakit.locks as locks

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
