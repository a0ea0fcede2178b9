"""One process at a time in a directory that holds resumable work, or that a build fills.

A pipeline's working directory and a layer-wise conversion's finished layers are resumed by the next
run with the same settings. Two processes at once would write the same files (or one would discard the
other's layers mid-run), and a later resume could read a mix of both. :func:`exclusive` takes an
operating-system lock on a file for the length of a ``with`` block; a second process that asks for it
is refused at once with the first one's pid and command, instead of waiting for hours.
:func:`one_at_a_time` waits instead, for work that takes a minute and that the second process needs
too (an asset being built into the cache: it then finds the asset there). Either lock goes with the
process: ``kill -9`` or a crash leaves nothing to clean up, and the lock file is removed on release.
On a filesystem whose ``flock`` does not work (NFS without a lock service, some FUSE mounts: one of
:data:`NO_LOCKS`), the block runs unguarded, with a warning, rather than not at all.
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from gqakit.errors import GqakitError

POLL_S = 0.2  # how often a waiting process tries the lock again
# what flock raises on a filesystem without working locks (NFS without lockd, some FUSE, Lustre noflock)
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
log = logging.getLogger(__name__)

if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def _owner_line() -> str:
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else ["python"]
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"pid {os.getpid()} on {socket.gethostname()} since {started}: {shlex.join(argv)}"


def _owner_of(path: Path) -> str:
    try:
        return path.read_text().strip() or "a process that is starting"
    except OSError:
        return "a process that just finished"


def _acquire(path: Path, busy: Callable[[str], None], strict: bool = False) -> int:
    """The open, locked descriptor of ``path``. While another process holds it, ``busy`` is called with
    that process's description: it raises to refuse, or returns to wait for the lock. Where the filesystem
    cannot lock (:data:`NO_LOCKS`), the descriptor unlocked, with a warning; with ``strict``, flock's
    OSError."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_lock(fd):
                busy(_owner_of(path))
                while not _try_lock(fd):
                    time.sleep(POLL_S)
        except OSError as e:
            if strict or e.errno not in NO_LOCKS:
                os.close(fd)
                raise
            # gqakit worked on such filesystems before it locked anything: go on, unguarded, and say so
            log.warning(
                "could not lock %s: %s (this filesystem has no working flock); going on without the lock, "
                "so a second command on the same files at the same time would not be stopped",
                path, e,
            )  # fmt: skip
            return fd
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        # the holder released and removed the file between our open and our lock: the lock we hold is on
        # a file nobody else will open again, so take the new one
        os.close(fd)


@contextmanager
def _held(path: Path, busy: Callable[[str], None], strict: bool = False) -> Iterator[None]:
    fd = _acquire(path, busy, strict)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, (_owner_line() + "\n").encode())
        yield
    finally:
        # removed while still locked, so no process can lock this file after we let it go
        try:
            path.unlink()
        except OSError:
            pass
        os.close(fd)


OWNER = "{owner}"  # where a refusal message names the process that holds the lock


@contextmanager
def exclusive(lock_file: str | Path, busy: str, strict: bool = False) -> Iterator[None]:
    """Hold ``lock_file`` for the ``with`` block, or refuse if another process holds it.

    Args:
        lock_file: the lock's path; its directory must exist. Written with the holder's pid and command
            (what a refused process reports), removed on release.
        busy: the message for a refused process, with :data:`OWNER` where the holder's description goes,
            e.g. ``"--work-dir w is in use ({owner}): wait for it, or pass another --work-dir."``.
        strict: raise flock's OSError where the filesystem cannot lock, instead of running unguarded.

    Raises:
        GqakitError: ``busy`` filled in, when another process holds the lock.
    """

    def refuse(owner: str) -> None:
        raise GqakitError(busy.replace(OWNER, owner))

    with _held(Path(lock_file), refuse, strict):
        yield


@contextmanager
def one_at_a_time(lock_file: str | Path, waiting: Callable[[str], None]) -> Iterator[None]:
    """Hold ``lock_file`` for the ``with`` block, waiting while another process holds it.

    Args:
        lock_file: the lock's path; its directory must exist.
        waiting: called once, with the holder's description, when this process has to wait (to say so).
    """
    with _held(Path(lock_file), waiting):
        yield


@contextmanager
def working_directory(work_dir: str | Path, option: str = "--work-dir") -> Iterator[Path]:
    """Create ``work_dir`` if needed and hold it for one pipeline run; yield it resolved.

    Raises:
        GqakitError: when it cannot be created, or another run holds it.
    """
    work = Path(work_dir).expanduser().resolve()
    busy = (
        f"{option} {work} is in use by another run ({OWNER}). Two runs in one working directory would "
        f"write the same checkpoints: wait for that run to finish, or pass another {option}."
    )
    with ExitStack() as held:
        try:  # a directory that cannot be made, or an existing one that cannot be written (the lock file)
            work.mkdir(parents=True, exist_ok=True)
            held.enter_context(exclusive(work / ".gqakit-lock", busy))
        except OSError as e:
            raise GqakitError(
                f"{option} {work_dir} cannot be created or written ({e.strerror}): choose a directory you "
                "can write to."
            ) from None
        yield work


__all__ = ["OWNER", "exclusive", "one_at_a_time", "working_directory"]
