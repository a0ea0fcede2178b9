"""Locks (:func:`exclusive`, :func:`one_at_a_time`): one process at a time in a directory of resumable
work or a cache entry being built. Two processes at once would write the same files, and a later resume
could read a mix of both. A lock goes with its process (``kill -9`` leaves nothing to clean up); on a
filesystem whose ``flock`` does not work (NFS without a lock service, some FUSE mounts: :data:`NO_LOCKS`)
the block runs unguarded, with a warning, rather than not at all.
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

log = logging.getLogger(__name__)


if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    fcntl = None  # no shared locks: cached copies are handed out without one, and none is removed
else:
    import fcntl


POLL_S = 0.2  # how often a waiting process tries the lock again
# what flock raises on a filesystem without working locks (NFS without lockd, some FUSE, Lustre noflock)
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
OWNER = "{owner}"  # where a refusal message names the process that holds the lock


def _flock(fd: int, shared: bool = False, wait: bool = False) -> bool:
    """Lock the open file ``fd`` (exclusively, or ``shared``); False when another process holds it and
    ``wait`` is false. Any other failure is flock's OSError."""
    if fcntl is None:  # pragma: no cover - Windows: exclusive locks only
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def _same(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open at ``fd`` (no release or removal unlinked it)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


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
            if not _flock(fd):
                busy(_owner_of(path))
                while not _flock(fd):
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
        if _same(fd, path):
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


@contextmanager
def exclusive(lock_file: str | Path, busy: str, strict: bool = False) -> Iterator[None]:
    """Hold ``lock_file`` (in an existing directory) for the ``with`` block, or refuse at once if another
    process holds it, instead of waiting for hours: a :class:`GqakitError` of ``busy`` with :data:`OWNER`
    replaced by the holder's pid and command (which the file holds until release removes it). ``strict``:
    raise flock's OSError where the filesystem cannot lock, instead of running unguarded."""

    def refuse(owner: str) -> None:
        raise GqakitError(busy.replace(OWNER, owner))

    with _held(Path(lock_file), refuse, strict):
        yield


@contextmanager
def one_at_a_time(lock_file: str | Path, waiting: Callable[[str], None]) -> Iterator[None]:
    """Hold ``lock_file`` for the ``with`` block, waiting while another process holds it (work that takes
    a minute and that this process needs too); ``waiting`` is called once with the holder's description."""
    with _held(Path(lock_file), waiting):
        yield


@contextmanager
def working_directory(work_dir: str | Path, option: str = "--work-dir") -> Iterator[Path]:
    """Create ``work_dir`` if needed and hold it for one pipeline run (:func:`exclusive`); yield it
    resolved."""
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


@contextmanager
def building(lock_file: Path, what: str, logger: logging.Logger = log) -> Iterator[None]:
    """Hold ``lock_file`` while this process builds ``what`` into the cache; a second process asking for
    the same thing waits (saying so once) and then finds it built, instead of building it over the first."""

    def waiting(owner: str) -> None:
        logger.warning("waiting for %s, which is %s", owner, what)

    with one_at_a_time(lock_file, waiting):
        yield
