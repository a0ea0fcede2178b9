"""Locks (:func:`exclusive`, :func:`one_at_a_time`): one process at a time in a working directory, an
output being written or a cache entry being built, as docs/reliability.md promises. A lock goes with its
process; where ``flock`` does not work (:data:`NO_LOCKS`) the block runs unguarded, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gqakit.errors import GqakitError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, every lock runs unguarded
    fcntl = None

log = logging.getLogger(__name__)

# what flock raises on a filesystem without working locks (NFS without lockd, some FUSE, Lustre noflock)
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
OWNER = "{owner}"  # where a refusal message names the process that holds the lock


def _flock(fd: int, wait: bool) -> bool:
    """Lock the open file ``fd`` exclusively; False when another process holds it and ``wait`` is false."""
    if fcntl is None:  # pragma: no cover - Windows
        raise OSError(errno.ENOSYS, "no flock on this platform")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def _owner_of(path: Path) -> str:
    try:
        return path.read_text().strip() or "a process that is starting"
    except OSError:
        return "a process that just finished"


def _acquire(path: Path, busy: Callable[[str], None]) -> int:
    """The open, locked descriptor of ``path``. While another process holds it, ``busy`` is called with
    that process's description: it raises to refuse, or returns to wait for the lock. Where the filesystem
    cannot lock (:data:`NO_LOCKS`), the descriptor unlocked, with a warning."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _flock(fd, wait=False):
                busy(_owner_of(path))
                _flock(fd, wait=True)
        except OSError as e:
            if e.errno not in NO_LOCKS:
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
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        # the holder released and removed the file between our open and our lock: the lock we hold is on
        # a file nobody else will open again, so take the new one
        os.close(fd)


@contextmanager
def one_at_a_time(lock_file: str | Path, waiting: Callable[[str], None]) -> Iterator[None]:
    """Hold ``lock_file`` for the ``with`` block, waiting while another process holds it (work that takes
    a minute and that this process needs too); ``waiting`` is called once with the holder's description
    (it may raise instead, to refuse: :func:`exclusive`)."""
    path = Path(lock_file)
    fd = _acquire(path, waiting)
    try:
        argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else ["python"]
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        owner = f"pid {os.getpid()} on {socket.gethostname()} since {since}: {shlex.join(argv)}\n"
        os.ftruncate(fd, 0)
        os.write(fd, owner.encode())
        yield
    finally:
        # removed while still locked, so no process can lock this file after we let it go
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def exclusive(lock_file: str | Path, busy: str):
    """Hold ``lock_file`` (in an existing directory) for the ``with`` block, or refuse at once if another
    process holds it, instead of waiting for hours: a :class:`GqakitError` of ``busy`` with :data:`OWNER`
    replaced by the holder's pid and command (which the file holds until release removes it)."""

    def refuse(owner: str) -> None:
        raise GqakitError(busy.replace(OWNER, owner))

    return one_at_a_time(lock_file, refuse)


def building(lock_file: Path, what: str, logger: logging.Logger = log):
    """:func:`one_at_a_time` while this process builds ``what`` into the cache: a second process asking for
    the same thing waits (saying so once) and then finds it built, instead of building it over the first."""
    return one_at_a_time(lock_file, lambda owner: logger.warning("waiting for %s, which is %s", owner, what))
