"""The two caches of copies made from a source that changes (under :func:`gqakit.storage.cache_root`):
``.gguf`` files dequantized into checkpoints (:mod:`gqakit.gguf.dequantize`) and checkpoints exported to
GGUF for llama.cpp (:mod:`gqakit.eval.llamacpp_engine`), whose rules are at :func:`write_record`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError
from gqakit.locks import NO_LOCKS, OWNER, _flock, _same, building, exclusive, fcntl
from gqakit.storage import cache_root, fingerprint, writable_cache, write_json

log = logging.getLogger(__name__)

FINGERPRINT = "fingerprint"  # the record's key for the source's fingerprint
HOST = "host"  # the record's key for the machine that wrote it (write_record adds it)
ATTEMPTS = 5  # how often in_use asks for a copy that is removed as it is handed out
_NO_FLOCK = False  # set once flock has failed so: this process holds nothing and removes nothing since
# the copies this process holds in use, each with the open descriptor of its locked .use file; kept open
# (the lock held) until the process exits
_HELD: dict[Path, int] = {}
_HELD_LOCK = threading.Lock()


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    """Write a cached copy's record of its source (:func:`cached_copy`; creating its folder), with this
    machine's name: only copies this machine recorded (``"host"``) are judged by their source here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {**record, HOST: socket.gethostname()})


def _read_record(path: Path) -> dict[str, Any] | None:
    """The record at ``path``; None when it is unreadable or not a JSON object (FileNotFoundError raised)."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _elsewhere(record: dict[str, Any]) -> bool:
    """Whether another machine wrote ``record`` (a cache shared over the network): its source path is that
    machine's, so whether it exists here says nothing, and the copy is that machine's to replace."""
    return record.get(HOST, socket.gethostname()) != socket.gethostname()


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


def superseded_by_record(
    record_path: Path, current: Mapping[str, Any], version_key: str, legacy: Callable[[], bool]
) -> bool:
    """Whether the copy whose record is at ``record_path`` is superseded by the copy recorded as ``current``.

    It is when its record matches ``current`` on every key but the fingerprint and the version ``version_key``
    (an integer), and either its fingerprint differs (the source has changed since) or its version is
    older; or when it is an orphan (:func:`orphaned`), whatever the other keys. A newer version's record is
    left to the gqakit that wrote it, and an unreadable record keeps its copy: removing a copy that might
    still be wanted costs a rebuild, keeping one costs only space. Without a record (a copy from before
    records), ``legacy`` answers: the cache's own rule, by the copy's name.
    """
    try:
        record = _read_record(record_path)
    except FileNotFoundError:
        return legacy()
    if record is None:
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
    """Whether the copy whose record is at ``record_path`` is an orphan: its recorded ``"source"`` no
    longer exists, so nothing asks for it again (unless the same contents reappear there, which costs a
    rebuild). No record, an unreadable one, or a source that cannot be looked at is not an orphan."""
    try:
        record = _read_record(record_path)
    except FileNotFoundError:
        return False
    return record is not None and not _elsewhere(record) and _gone(record.get("source"))


@dataclass(frozen=True)
class CopyKind:
    """One cache of copies (:func:`cached_copy`): where its copies are, and how :func:`remove_superseded`
    removes and names one."""

    noun: tuple[str, str]  # a copy in messages, singular and plural: ("copy", "copies")
    described: str  # a copy where a removal is logged: "a dequantized copy"
    log: logging.Logger  # the cache module's (its messages are that module's)
    # deletes one copy and returns the bytes it held, None when another process removed it first; raises
    # OSError when it cannot
    remove: Callable[[Path], int | None]
    rm: Callable[[Path], str]  # the shell command that removes what is left of a copy whose removal failed
    # a copy's record (an orphan this process holds is kept); None: every copy this process holds is let go
    record: Callable[[Path], Path] | None = None
    folder: str = ""  # the cache's folder under the cache root
    pattern: str = "*"  # the entries of that folder that may be copies...
    is_copy: Callable[[Path], bool] = Path.is_dir  # ...and of which kind (Path.is_dir, Path.is_file)
    complete: Callable[[Path], bool] = Path.exists  # whether a copy can be handed out
    ready: Callable[[Path], bool] | None = None  # whether it needs no build; None: when complete
    version_key: str = "version"  # the record's key for the writer's version...
    version: Callable[[], int] = lambda: 0  # ...and the version, read when asked (tests raise it)
    # a copy's name: a format of the source's "stem" and "name", its fingerprint "fp", "version" and the
    # keys a copy records to match (cached_copy)
    name: str = "{name}-{fp}"
    # the names of copies written before records: a regular expression of the same keys (escaped), whose
    # group 1 is the version (absent: the oldest names had none)
    legacy: str = ""


def cached_copy(
    kind: CopyKind, source: Path, build: Callable[[Path, dict[str, Any]], None], what: str, **match: Any
) -> Path:
    """The copy of ``source`` (resolved) in ``kind``'s cache, found or built, held in use until this
    process exits (:func:`in_use`): the one flow of the dequantized-GGUF and llama.cpp-export caches.

    A copy is named by ``kind.name`` (the source's fingerprint and the writer's version in it), so a
    rewritten source or a newer gqakit writes a new copy beside the old one, which nothing opens again.
    When the copy is not ``kind.ready``, ``build(copy, record)`` writes it and its record
    (:func:`write_record`: the source's absolute ``"source"`` path, its ``"fingerprint"``, the writer's
    version and the keys in ``match``, which have to match for one copy to supersede another) under the
    copy's lock (:func:`building`; ``what`` for a process that waits): a second process asking for it
    waits for the first's copy instead of writing its own over it. Then, whether written or reused, the
    copies it supersedes go (:func:`sweep`): on reuse too, as one kept while another process held it goes
    once none does.
    """

    def get() -> Path:
        fp = fingerprint(source)
        copy = writable_cache(cache_root() / kind.folder) / copy_name(kind, source, fp, **match)
        ready = kind.ready or kind.complete
        if not ready(copy):
            with building(copy.parent / f".{copy.name}.lock", what.format(copy=copy), kind.log):
                if not ready(copy):
                    build(copy, _source_record(kind, source, fp, match))
        sweep(kind, source, copy, **match)
        return copy

    return in_use(get, kind.complete)


def copy_name(kind: CopyKind, source: Path, fp: str, **match: Any) -> str:
    """The name of the copy of ``source`` at fingerprint ``fp`` (``kind.name``)."""
    return kind.name.format(stem=source.stem, name=source.name, fp=fp, version=kind.version(), **match)


def _source_record(kind: CopyKind, source: Path, fp: str, match: Mapping[str, Any]) -> dict[str, Any]:
    return {"source": str(source), FINGERPRINT: fp, **match, kind.version_key: kind.version()}


def sweep(kind: CopyKind, source: Path, current: Path, **match: Any) -> list[Path]:
    """Remove the copies in ``current``'s cache folder that ``current``, the copy of ``source`` named and
    recorded as :func:`cached_copy` says, supersedes; return them.

    Nothing is removed when ``source`` has changed again since ``current`` was written (the copy of its
    new contents removes the others). A copy with a record is judged by :func:`superseded_by_record`; one
    without a record (an older gqakit's, which this gqakit never opens) by its name: superseded when it
    matches ``kind.legacy`` in full with an older version than this writer's (or none). A copy without a
    record named with this version or a newer one is kept. Copies another process writes or holds are
    kept (:func:`remove_superseded`).
    """

    def candidates() -> list[Path]:
        fp = fingerprint(source)
        if copy_name(kind, source, fp, **match) != current.name:
            return []
        record = _source_record(kind, source, fp, match)
        escaped = {
            k: re.escape(str(v)) for k, v in {"stem": source.stem, "name": source.name, **match}.items()
        }
        legacy = kind.legacy.format(**escaped)

        def superseded(copy: Path) -> bool:
            def by_name() -> bool:
                found = re.fullmatch(legacy, copy.name)
                return found is not None and int(found.group(1) or 1) < kind.version()

            return superseded_by_record(kind.record(copy), record, kind.version_key, by_name)

        # the other copies: hidden entries (locks, partial copies) and links left out
        return [
            p for p in current.parent.glob(kind.pattern)
            if p != current and not p.name.startswith(".") and not p.is_symlink() and kind.is_copy(p)
            and superseded(p)
        ]  # fmt: skip

    return remove_superseded(kind, source.name, current, candidates)


def use_file(copy: Path) -> Path:
    """The file whose shared lock holds ``copy`` in use: ``.<name>.use`` beside it."""
    return copy.with_name(f".{copy.name}.use")


def in_use(get: Callable[[], Path], complete: Callable[[Path], bool]) -> Path:
    """The copy ``get`` finds or writes, held in use by this process until it exits.

    A process may take a copy and open it much later (``gqakit eval`` dequantizes every model first and
    loads each in turn), so a copy is handed out only under a shared lock on its :func:`use_file`, which
    :func:`remove_superseded` would need exclusively. A removal may take the copy between ``get`` and the
    lock: the copy must still be ``complete`` under the lock, or ``get`` is asked again (it writes the copy
    anew), up to :data:`ATTEMPTS` times. Where ``flock`` fails (:data:`NO_LOCKS`, logged once at debug
    level) the copy is handed out without a hold, and this process removes nothing from then on.
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
        log.debug("flock fails here (%s): cached copies are handed out without a hold, none is removed", e)
    return True


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
                _flock(fd, shared=True, wait=True)  # waits only while a removal holds it (the copy is going)
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
        # this process may have created the .use file for a copy already gone: unlink it as a removal
        # does, exclusively locked, unless another process holds it
        try:
            if _flock(fd) and _same(fd, path) and not complete(copy):
                path.unlink()
        except OSError:
            pass
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


class _Kept(Exception):
    """A copy that is not removed: held in use (by ``args[0]``), or no working ``flock`` (``no_locks``)."""

    def __init__(self, by: str = "another process", no_locks: bool = False) -> None:
        super().__init__(by)
        self.no_locks = no_locks


def _remove_unused(kind: CopyKind, copy: Path, orphan: bool = False) -> int | None:
    """``kind.remove(copy)`` under an exclusive lock on its :func:`use_file`, which is unlinked once the
    copy is gone, still locked, so a reader waiting on it sees that it was (:func:`_hold`); :class:`_Kept`
    when another process holds the copy (or this one, an ``orphan``), or ``flock`` fails."""
    if orphan and copy in _HELD:
        raise _Kept("this process")  # its source is gone, not replaced by the one this process asks for
    release(copy)  # this process asks for a newer copy of the source: it has moved on from this one
    path = use_file(copy)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            locked = _flock(fd)  # never waits: this process may be a reader
        except OSError as e:
            if _no_flock(e):
                raise _Kept(no_locks=True) from None
            raise
        if not locked:
            raise _Kept
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
    """Remove the copies ``candidates`` lists (superseded or orphaned: may raise OSError) beside ``current``,
    the copy just written or reused, and return them.

    Each is removed under its writer's lock (``.<name>.lock``) and an exclusive lock on its
    :func:`use_file`, so a copy that another process is writing or holds in use is kept, with an info
    line; this process's own hold on it is let go first (it asks for the newer copy now), but not on an
    orphan. Each removal is logged with its size; a failure is a warning and nothing more: the command has
    its copy. Without ``flock`` (Windows, or :data:`NO_LOCKS`) nothing is removed: a superseded copy costs
    space, a removed copy in use would cost a failed command.
    """
    one, many = kind.noun
    if fcntl is None or _NO_FLOCK:  # no shared locks tell which copies are in use
        kind.log.debug("kept the superseded %s of %s: no flock to tell which are in use", many, source_name)
        return []
    removed: list[Path] = []
    try:  # the command has its copy: a failed sweep is never its failure
        copies = sorted(candidates())
        for copy in copies:
            busy = f"kept {copy}, a superseded {one} of {source_name}: {OWNER} is writing it"
            gone = kind.record is not None and orphaned(kind.record(copy))  # read before the copy goes
            try:
                with exclusive(current.parent / f".{copy.name}.lock", busy, strict=True):
                    size = _remove_unused(kind, copy, gone)
            except GqakitError as e:  # its lock is held
                kind.log.info("%s", e.message)
                continue
            except _Kept as e:
                if e.no_locks:
                    return removed
                kind.log.info("kept %s, a superseded %s of %s: it is in use by %s", copy, one, source_name, e)
                continue
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
    except Exception as e:
        kind.log.warning("could not remove the superseded %s of %s: %s", many, source_name, e)
    return removed
