"""Cached copies that replace the ones they supersede: each copy's record of its source, and the removal.

Two caches hold full-size files made from a source that changes: a ``.gguf`` dequantized into a
checkpoint (:mod:`gqakit.gguf.dequantize`) and a checkpoint exported to GGUF for llama.cpp
(:mod:`gqakit.eval.llamacpp_engine`). Each names its copies by the source's fingerprint and the writer's
version, so a rewritten source or a newer gqakit writes a new copy beside the old one, which nothing
opens again. Each copy therefore records where it came from (:func:`write_record`: the source's absolute
path, fingerprint and the writer's version, plus whatever else tells two copies of one source apart), and
once a new copy is complete the cache removes the copies whose record names the same source with another
fingerprint or an older version (:func:`superseded_by_record`, :func:`remove_superseded`). A copy whose
recorded source no longer exists (a file or directory deleted or renamed: an orphan) goes too, whatever its
source: nothing asks for it again unless the same contents reappear at that path, which costs a rebuild. An
export of a dequantized copy, for one, is orphaned once that copy is replaced. The cache sweeps both when it
writes a copy and when it reuses one (a listing and a few small records), so a copy kept while in use goes
once nothing holds it. A copy whose lock another process holds (it is writing that copy) is kept.

A copy in use is kept too. A process may take a copy and open it much later (``gqakit eval`` dequantizes
every model first and loads each in turn; a recovery run reloads its source as the teacher), so the cache
hands a copy out only under a shared lock that the process holds until it exits (:func:`in_use`: a
``flock`` on ``.<copy>.use`` beside the copy, taken once per copy and process). A removal takes that file
exclusively, without waiting: a copy that any other process holds is kept, with an info line. A process
that asks for a source's new copy has moved on from that source's earlier ones, so its own holds on the
copies the new one supersedes are let go first (otherwise a command could never replace a copy it once
read); an orphan it holds is kept. Where there is no ``flock`` (Windows, or a filesystem whose ``flock``
fails: ENOLCK, ENOTSUP, ENOSYS, EINVAL), copies are handed out without a hold and that process removes
nothing: a superseded copy costs space, a removed copy in use costs a failed command.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError
from gqakit.files import write_json
from gqakit.locks import NO_LOCKS, exclusive

if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    fcntl = None  # no shared locks: copies are handed out without one, and none is removed
else:
    import fcntl

FINGERPRINT = "fingerprint"  # the record's key for the source's fingerprint
HOST = "host"  # the record's key for the machine that wrote it (write_record adds it)
ATTEMPTS = 5  # how often in_use asks for a copy that is removed as it is handed out
_NO_FLOCK = False  # set once flock has failed so: this process holds nothing and removes nothing since

# the copies this process holds in use, each with the open descriptor of its locked .use file; kept open
# (the lock held) until the process exits
_HELD: dict[Path, int] = {}
_HELD_LOCK = threading.Lock()


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    """Write a copy's record of its source as JSON, creating its folder.

    Args:
        path: where the record goes.
        record: the source's ``"source"`` (absolute path) and ``"fingerprint"``, the writer's version
            under a key of the cache's own, and any other key that has to match for one copy to supersede
            another. The machine's name is added (``"host"``): only copies this machine recorded are
            judged by their source here.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {**record, HOST: socket.gethostname()})


def _elsewhere(record: dict[str, Any]) -> bool:
    """Whether another machine wrote ``record`` (a cache shared over the network): its source path is that
    machine's, so whether it exists here says nothing, and the copy is that machine's to replace."""
    return record.get(HOST, socket.gethostname()) != socket.gethostname()


def superseded_by_record(
    record_path: Path, current: Mapping[str, Any], version_key: str, legacy: Callable[[], bool]
) -> bool:
    """Whether the copy whose record is at ``record_path`` is superseded by the copy recorded as ``current``.

    It is when its record matches ``current`` on every key but the fingerprint and the version (the same
    source, and whatever else the cache keys copies by), and either its fingerprint differs (the source
    has changed since) or its version is older. It is also when its recorded ``"source"`` no longer exists
    (:func:`orphaned`), whatever the other keys. A record with a newer version is left to the gqakit that
    wrote it, and an unreadable record, or one that is not a JSON object, keeps its copy: removing a copy
    that might still be wanted costs a rebuild, keeping one costs only space.

    Args:
        record_path: the other copy's record.
        current: the record of the copy just written.
        version_key: the key of the writer's version in both records (an integer).
        legacy: what to answer when there is no record at all (a copy from before records): the cache's
            own rule, by the copy's name.
    """
    try:
        record = json.loads(record_path.read_text())
    except FileNotFoundError:
        return legacy()
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict):
        return False
    version = record.get(version_key)
    if _elsewhere(record) or not isinstance(version, int) or version > current[version_key]:
        return False
    if _gone(record.get("source")):
        return True
    if any(record.get(k) != v for k, v in current.items() if k not in (FINGERPRINT, version_key)):
        return False
    return record.get(FINGERPRINT) != current[FINGERPRINT] or version < current[version_key]


def orphaned(record_path: Path) -> bool:
    """Whether the copy whose record is at ``record_path`` is an orphan: its recorded ``"source"`` (an
    absolute path) no longer exists. Nothing asks for such a copy again (unless the same contents reappear
    at that path, which costs only a rebuild). No record, an unreadable one, or a source that cannot be
    looked at (permissions) is not an orphan."""
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and not _elsewhere(record) and _gone(record.get("source"))


def _gone(source: Any) -> bool:
    if not isinstance(source, str) or not os.path.isabs(source):
        return False
    try:
        os.stat(source)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except (OSError, ValueError):
        return False
    return False


@dataclass(frozen=True)
class CopyKind:
    """How :func:`remove_superseded` removes and names one cache's copies.

    Attributes:
        noun: a copy in messages, singular and plural: ``("copy", "copies")``.
        described: a copy where a removal is logged: ``"a dequantized copy"``.
        log: the logger of the cache's module (its messages are that module's).
        remove: deletes one copy and returns the bytes it held, or None when it is gone already (another
            process removed it first); raises OSError when it cannot.
        rm: the shell command that removes what is left of a copy whose removal failed.
        record: a copy's record (:func:`orphaned`: an orphan that this process holds is kept); None: every
            copy this process holds is let go.
    """

    noun: tuple[str, str]
    described: str
    log: logging.Logger
    remove: Callable[[Path], int | None]
    rm: Callable[[Path], str]
    record: Callable[[Path], Path] | None = None


def siblings(current: Path, pattern: str, kind: Callable[[Path], bool]) -> list[Path]:
    """The other copies in ``current``'s cache folder: entries matching ``pattern`` of the ``kind`` given
    (``Path.is_dir``, ``Path.is_file``), hidden ones (locks, partial copies) and links left out."""
    return [
        p for p in current.parent.glob(pattern)
        if p != current and not p.name.startswith(".") and not p.is_symlink() and kind(p)
    ]  # fmt: skip


def use_file(copy: Path) -> Path:
    """The file whose shared lock holds ``copy`` in use: ``.<name>.use`` beside it."""
    return copy.with_name(f".{copy.name}.use")


def in_use(get: Callable[[], Path], complete: Callable[[Path], bool]) -> Path:
    """The copy ``get`` returns, held in use by this process until it exits.

    ``get`` finds or writes the copy (and removes the ones it supersedes). The copy is then held under a
    shared lock on its :func:`use_file`, so that no other process's :func:`remove_superseded` removes it.
    A removal may have taken the copy between ``get`` and the lock: the lock is taken on the file that is
    still linked, and the copy must still be ``complete`` under it, or ``get`` is asked again (and writes
    the copy anew). A copy this process already holds is not locked again. Where ``flock`` fails with one
    of :data:`NO_LOCKS` the copy is handed out without a hold (logged once, at debug level), and this
    process removes nothing from then on (:func:`remove_superseded`).

    Args:
        get: returns the copy, complete.
        complete: whether a copy is all there (what its readers open).

    Raises:
        GqakitError: when the copy was removed as it was handed out :data:`ATTEMPTS` times running.
    """
    for _ in range(ATTEMPTS):
        copy = get()
        if _hold(copy, complete):
            return copy
    raise GqakitError(
        f"{copy} was removed each time it was handed out ({ATTEMPTS} times): its source keeps changing, or "
        "other commands keep replacing it; run this one again once they are done."
    )


def _no_flock(e: OSError) -> bool:
    """Whether ``e`` says this filesystem has no working ``flock``; the first time, log it and stop
    removing copies in this process (it cannot tell which ones others hold)."""
    global _NO_FLOCK
    if e.errno not in NO_LOCKS:
        return False
    if not _NO_FLOCK:
        _NO_FLOCK = True
        logging.getLogger(__name__).debug(
            "flock fails here (%s): cached copies are handed out without a hold, and none is removed", e
        )
    return True


def _same(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open at ``fd`` (no removal unlinked it)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _hold(copy: Path, complete: Callable[[Path], bool]) -> bool:
    """Hold ``copy`` in use; False when it is no longer complete (a removal took it)."""
    if not complete(copy):
        return False
    if fcntl is None or _NO_FLOCK:  # no flock: nothing is removed, so nothing needs holding
        return True
    with _HELD_LOCK:
        if copy in _HELD:  # held since an earlier call: no other process has removed it
            return True
    path = use_file(copy)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a removal holds it (the copy is going)
            except OSError as e:
                if not _no_flock(e):
                    raise
                os.close(fd)
                return True
            same = _same(fd, path)
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # a removal unlinked it after our open: the copy is gone, or another file guards it
        if not complete(copy):
            return False  # gone: opening the path again would leave a .use file for no copy
    if not complete(copy):
        _unlink_use(fd, path, copy, complete)
        os.close(fd)
        return False
    with _HELD_LOCK:
        if copy in _HELD:  # another thread took it meanwhile
            os.close(fd)
        else:
            _HELD[copy] = fd
    return True


def _unlink_use(fd: int, path: Path, copy: Path, complete: Callable[[Path], bool]) -> None:
    """Unlink ``path`` (open at ``fd``, which this process may have created for a copy already gone) when
    no other process holds it and the copy is still gone: as a removal does, exclusively locked."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _same(fd, path) and not complete(copy):
            path.unlink()
    except OSError:  # another process holds it, or it is gone: not ours to remove
        pass


def release(copy: Path) -> None:
    """Let go of this process's hold on ``copy``, if it holds it."""
    with _HELD_LOCK:
        fd = _HELD.pop(copy, None)
    if fd is not None:
        os.close(fd)


class _InUse(Exception):
    """A copy that another process holds in use."""


class _NoLocks(Exception):
    """A filesystem whose ``flock`` fails: no copy is removed."""


def _remove_unused(kind: CopyKind, copy: Path, orphan: bool = False) -> int | None:
    """``kind.remove(copy)`` under an exclusive lock on its :func:`use_file`; raises :class:`_InUse` when
    another process holds it (or this one, for an ``orphan``), :class:`_NoLocks` where ``flock`` fails.
    The file is unlinked once the copy is gone, while still locked, so a reader waiting on it sees that it
    was (:func:`_hold`)."""
    if orphan and copy in _HELD:
        raise _InUse("this process")  # its source is gone, not replaced by the one this process asks for
    release(copy)  # this process asks for a newer copy of the source: it has moved on from this one
    path = use_file(copy)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # never waits: this process may be a reader
        except BlockingIOError:
            raise _InUse from None
        except OSError as e:
            if _no_flock(e):
                raise _NoLocks from None
            raise
        if not _same(fd, path):  # another removal unlinked it: that one saw to the copy
            return None
        size = kind.remove(copy)
        path.unlink(missing_ok=True)
        return size
    finally:
        os.close(fd)


def remove_superseded(
    kind: CopyKind, source_name: str, current: Path, candidates: Callable[[], Iterable[Path]]
) -> list[Path]:
    """Remove each copy that ``candidates`` names, unless another process is writing or using it.

    Each copy is removed under its lock (``.<name>.lock`` beside it, the one its writer holds) and an
    exclusive lock on its :func:`use_file`, so a copy that another process is writing, or holds in use
    (:func:`in_use`), is kept, with an info line; this process's own hold on it is let go first. Each
    removal is logged with its size; a copy that cannot be removed, or a cache that cannot be listed, is
    a warning and nothing more: the command that wrote or reuses ``current`` has what it needs. Without
    ``flock`` (Windows, or a filesystem where it fails: :data:`NO_LOCKS`) nothing is removed.

    Args:
        kind: the cache's copies.
        source_name: the source's name, for messages.
        current: the copy just written or reused (in the cache's folder).
        candidates: lists the superseded and orphaned copies; may raise OSError.

    Returns:
        The copies removed.
    """
    try:
        return _remove_superseded(kind, source_name, current, candidates)
    except Exception as e:  # the command has its copy: a failed sweep is never its failure
        kind.log.warning("could not remove the superseded %s of %s: %s", kind.noun[1], source_name, e)
        return []


def _remove_superseded(
    kind: CopyKind, source_name: str, current: Path, candidates: Callable[[], Iterable[Path]]
) -> list[Path]:
    cache = current.parent
    one, many = kind.noun
    if fcntl is None or _NO_FLOCK:  # no shared locks tell which copies are in use
        kind.log.debug("kept the superseded %s of %s: no flock to tell which are in use", many, source_name)
        return []
    try:
        copies = sorted(candidates())
    except OSError as e:
        kind.log.warning("could not look for superseded %s of %s in %s: %s", many, source_name, cache, e)
        return []
    removed = []
    for copy in copies:
        busy = f"kept {copy}, a superseded {one} of {source_name}: {{owner}} is writing it"
        gone = kind.record is not None and orphaned(kind.record(copy))  # read before the copy goes
        try:
            with exclusive(cache / f".{copy.name}.lock", busy, strict=True):
                size = _remove_unused(kind, copy, gone)
        except GqakitError as e:  # its lock is held
            kind.log.info("%s", e.message)
            continue
        except _InUse as e:
            by = e.args[0] if e.args else "another process"
            kind.log.info("kept %s, a superseded %s of %s: it is in use by %s", copy, one, source_name, by)
            continue
        except _NoLocks:
            return removed
        except OSError as e:
            if _no_flock(e):  # its writer's lock file cannot be taken: as for its .use file
                return removed
            msg = "could not remove %s, a superseded %s of %s: %s; remove it: %s"
            kind.log.warning(msg, copy, one, source_name, e, kind.rm(copy))
            continue
        if size is None:
            continue
        removed.append(copy)
        why = "whose source is gone" if gone else f"superseded by {current.name}"
        kind.log.info("removed %s (%.1f MiB), %s %s", copy, size / 2**20, kind.described, why)
    return removed


__all__ = [
    "ATTEMPTS", "FINGERPRINT", "HOST", "NO_LOCKS", "CopyKind", "in_use", "orphaned",
    "release", "remove_superseded", "siblings", "superseded_by_record", "use_file", "write_record",
]  # fmt: skip
