"""Cached copies that replace the ones they supersede: each copy's record of its source, and the removal.

Two caches hold full-size files made from a source that changes: a ``.gguf`` dequantized into a
checkpoint (:mod:`gqakit.gguf.dequantize`) and a checkpoint exported to GGUF for llama.cpp
(:mod:`gqakit.eval.llamacpp_engine`). Each names its copies by the source's fingerprint and the writer's
version, so a rewritten source or a newer gqakit writes a new copy beside the old one, which nothing
opens again. Each copy therefore records where it came from (:func:`write_record`: the source's absolute
path, fingerprint and the writer's version, plus whatever else tells two copies of one source apart), and
once a new copy is complete the cache removes the copies whose record names the same source with another
fingerprint or an older version (:func:`superseded_by_record`, :func:`remove_superseded`). A copy whose
lock another process holds (it is writing that copy) is kept.

A copy in use is kept too. A process may take a copy and open it much later (``gqakit eval`` dequantizes
every model first and loads each in turn; a recovery run reloads its source as the teacher), so the cache
hands a copy out only under a shared lock that the process holds until it exits (:func:`in_use`: a
``flock`` on ``.<copy>.use`` beside the copy, taken once per copy and process). A removal takes that file
exclusively, without waiting: a copy that any other process holds is kept, with an info line. A process
that asks for a source's new copy has moved on from that source's earlier ones, so its own holds on the
copies the new one supersedes are let go first (otherwise a command could never replace a copy it once
read). Where there is no ``flock`` (Windows), nothing is removed: a superseded copy costs space, a removed
copy in use costs a failed command.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError
from gqakit.files import write_json
from gqakit.locks import exclusive

if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    fcntl = None  # no shared locks: copies are handed out without one, and none is removed
else:
    import fcntl

FINGERPRINT = "fingerprint"  # the record's key for the source's fingerprint
ATTEMPTS = 5  # how often in_use asks for a copy that is removed as it is handed out

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
            another.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, dict(record))


def superseded_by_record(
    record_path: Path, current: Mapping[str, Any], version_key: str, legacy: Callable[[], bool]
) -> bool:
    """Whether the copy whose record is at ``record_path`` is superseded by the copy recorded as ``current``.

    It is when its record matches ``current`` on every key but the fingerprint and the version (the same
    source, and whatever else the cache keys copies by), and either its fingerprint differs (the source
    has changed since) or its version is older. A record with a newer version is left to the gqakit that
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
    if any(record.get(k) != v for k, v in current.items() if k not in (FINGERPRINT, version_key)):
        return False
    version = record.get(version_key)
    if not isinstance(version, int) or version > current[version_key]:
        return False
    return record.get(FINGERPRINT) != current[FINGERPRINT] or version < current[version_key]


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
    """

    noun: tuple[str, str]
    described: str
    log: logging.Logger
    remove: Callable[[Path], int | None]
    rm: Callable[[Path], str]


def use_file(copy: Path) -> Path:
    """The file whose shared lock holds ``copy`` in use: ``.<name>.use`` beside it."""
    return copy.with_name(f".{copy.name}.use")


def in_use(get: Callable[[], Path], complete: Callable[[Path], bool]) -> Path:
    """The copy ``get`` returns, held in use by this process until it exits.

    ``get`` finds or writes the copy (and removes the ones it supersedes). The copy is then held under a
    shared lock on its :func:`use_file`, so that no other process's :func:`remove_superseded` removes it.
    A removal may have taken the copy between ``get`` and the lock: the lock is taken on the file that is
    still linked, and the copy must still be ``complete`` under it, or ``get`` is asked again (and writes
    the copy anew). A copy this process already holds is not locked again.

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


def _hold(copy: Path, complete: Callable[[Path], bool]) -> bool:
    """Hold ``copy`` in use; False when it is no longer complete (a removal took it)."""
    if not complete(copy):
        return False
    if fcntl is None:  # pragma: no cover - Windows: nothing is removed, so nothing needs holding
        return True
    with _HELD_LOCK:
        if copy in _HELD:  # held since an earlier call: no other process has removed it
            return True
    path = use_file(copy)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a removal holds it (the copy is going)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # a removal unlinked it after our open: the copy is gone, or another file guards it
    if not complete(copy):
        os.close(fd)
        return False
    with _HELD_LOCK:
        if copy in _HELD:  # another thread took it meanwhile
            os.close(fd)
        else:
            _HELD[copy] = fd
    return True


def release(copy: Path) -> None:
    """Let go of this process's hold on ``copy``, if it holds it."""
    with _HELD_LOCK:
        fd = _HELD.pop(copy, None)
    if fd is not None:
        os.close(fd)


class _InUse(Exception):
    """A copy that another process holds in use."""


def _remove_unused(kind: CopyKind, copy: Path) -> int | None:
    """``kind.remove(copy)`` under an exclusive lock on its :func:`use_file`; raises :class:`_InUse` when
    another process holds it. The file is unlinked once the copy is gone, while still locked, so a reader
    waiting on it sees that it was (:func:`_hold`)."""
    release(copy)  # this process asks for a newer copy of the source: it has moved on from this one
    path = use_file(copy)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # never waits: this process may be a reader
        except BlockingIOError:
            raise _InUse from None
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
    a warning and nothing more: the command that wrote ``current`` has what it needs. Without ``flock``
    (Windows) nothing is removed.

    Args:
        kind: the cache's copies.
        source_name: the source's name, for messages.
        current: the copy just written (in the cache's folder).
        candidates: lists the superseded copies; may raise OSError.

    Returns:
        The copies removed.
    """
    cache = current.parent
    one, many = kind.noun
    if fcntl is None:  # pragma: no cover - Windows: no shared locks tell which copies are in use
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
        try:
            with exclusive(cache / f".{copy.name}.lock", busy):
                size = _remove_unused(kind, copy)
        except GqakitError as e:  # its lock is held
            kind.log.info("%s", e.message)
            continue
        except _InUse:
            kind.log.info(
                "kept %s, a superseded %s of %s: it is in use by another process", copy, one, source_name
            )
            continue
        except OSError as e:
            kind.log.warning(
                "could not remove %s, a superseded %s of %s: %s; remove it: %s",
                copy,
                one,
                source_name,
                e,
                kind.rm(copy),
            )
            continue
        if size is None:
            continue
        removed.append(copy)
        kind.log.info(
            "removed %s (%.1f MiB), %s superseded by %s", copy, size / 2**20, kind.described, current.name
        )
    return removed


__all__ = [
    "ATTEMPTS",
    "FINGERPRINT",
    "CopyKind",
    "in_use",
    "release",
    "remove_superseded",
    "superseded_by_record",
    "use_file",
    "write_record",
]
