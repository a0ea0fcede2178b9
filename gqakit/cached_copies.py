"""The two caches of copies made from a source that changes (under :func:`gqakit.storage.cache_root`):
``.gguf`` files dequantized into checkpoints (:mod:`gqakit.gguf.dequantize`) and checkpoints exported to
GGUF for llama.cpp (:mod:`gqakit.eval.llamacpp_engine`), both through :func:`cached_copy`.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError
from gqakit.locks import OWNER, building, exclusive
from gqakit.storage import cache_root, fingerprint, writable_cache, write_json

FINGERPRINT = "fingerprint"  # the record's key for the source's fingerprint
HOST = "host"  # the record's key for the machine that wrote it (write_record adds it)


@dataclass(frozen=True)
class CopyKind:
    """One cache of copies (:func:`cached_copy`): where its copies are, how one is named, recorded,
    checked and removed."""

    folder: str  # the cache's folder under the cache root
    # a copy's name: a format of the source's "stem" and "name", its fingerprint "fp", "version" and the
    # keys a copy records to match (cached_copy)
    name: str
    version_key: str  # the record's key for the writer's version...
    version: Callable[[], int]  # ...and the version, read when asked (tests raise it)
    record: Callable[[Path], Path]  # where a copy's record of its source is
    complete: Callable[[Path], bool]  # whether a copy is whole and can be handed out
    # deletes one copy (and its record) and returns the bytes it held, None when it is already gone;
    # raises OSError when it cannot
    remove: Callable[[Path], int | None]
    rm: Callable[[Path], str]  # the shell command that removes what is left of a copy whose removal failed
    described: str  # a copy where a removal is logged: "a dequantized copy"
    log: logging.Logger  # the cache module's (its messages are that module's)


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    """Write a cached copy's record of its source (creating its folder), with this machine's name: a
    cache shared over the network holds other machines' copies, whose source paths are theirs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {**record, HOST: socket.gethostname()})


def copy_name(kind: CopyKind, source: Path, fp: str, **match: Any) -> str:
    """The name of the copy of ``source`` at fingerprint ``fp`` (``kind.name``)."""
    return kind.name.format(stem=source.stem, name=source.name, fp=fp, version=kind.version(), **match)


def cached_copy(
    kind: CopyKind, source: Path, build: Callable[[Path, dict[str, Any]], None], what: str, **match: Any
) -> Path:
    """The copy of ``source`` (resolved) in ``kind``'s cache, found or built.

    A copy is named by ``kind.name`` (the source's fingerprint and the writer's version in it), so a
    rewritten source or a newer gqakit gets a new copy, never a stale one. A missing copy is written by
    ``build(copy, record)``, with its record (:func:`write_record`: the source's absolute ``"source"``
    path, its ``"fingerprint"``, the writer's version and the keys in ``match``), under the copy's lock
    (:func:`gqakit.locks.building`; ``what`` for a process that waits): a second process asking for it
    waits for the first's copy instead of writing its own over it. The copies the new one supersedes then
    go (:func:`sweep`).
    """
    fp = fingerprint(source)
    copy = writable_cache(cache_root() / kind.folder) / copy_name(kind, source, fp, **match)
    if not kind.complete(copy):
        with building(copy.parent / f".{copy.name}.lock", what.format(copy=copy), kind.log):
            if not kind.complete(copy):
                record = {"source": str(source), FINGERPRINT: fp, **match, kind.version_key: kind.version()}
                build(copy, record)
                sweep(kind, copy, record)
    return copy


def _superseded(kind: CopyKind, copy: Path, current: Mapping[str, Any]) -> bool:
    """Whether ``copy``'s record names the source, machine and keys of ``current`` with another
    fingerprint (the source has changed since) or an older version. A newer gqakit's copy is left to it,
    and a copy without a readable record is kept: removing a copy that might still be wanted costs a
    rebuild, keeping one costs only space."""
    try:
        record = json.loads(kind.record(copy).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get(HOST) != socket.gethostname():
        return False
    version, now = record.get(kind.version_key), current[kind.version_key]
    if not isinstance(version, int) or version > now:
        return False
    if any(record.get(k) != v for k, v in current.items() if k not in (FINGERPRINT, kind.version_key)):
        return False
    return record.get(FINGERPRINT) != current[FINGERPRINT] or version < now


def sweep(kind: CopyKind, current: Path, record: Mapping[str, Any]) -> list[Path]:
    """Remove the copies beside ``current`` (just written, as ``record`` says) that it supersedes
    (:func:`_superseded`), and return them.

    A copy another process is writing (its lock is held) is kept, with an info line. Each removal is
    logged with its size; a failure is a warning naming the command that removes it, and nothing more:
    the command has its copy. A command that still reads a removed copy had its source rewritten under it.
    """
    removed = []
    name = Path(record["source"]).name
    for copy in sorted(current.parent.iterdir()):
        if copy == current or copy.name.startswith(".") or not _superseded(kind, copy, record):
            continue
        busy = f"kept {copy}, a superseded copy of {name}: {OWNER} is writing it"
        try:
            with exclusive(current.parent / f".{copy.name}.lock", busy):
                size = kind.remove(copy)
        except GqakitError as e:  # its lock is held
            kind.log.info("%s", e.message)
            continue
        except OSError as e:
            msg = "could not remove %s, a superseded copy of %s: %s; remove it: %s"
            kind.log.warning(msg, copy, name, e, kind.rm(copy))
            continue
        if size is not None:  # None: another process removed it first
            removed.append(copy)
            why = f"superseded by {current.name}"
            kind.log.info("removed %s (%.1f MiB), %s %s", copy, size / 2**20, kind.described, why)
    return removed
