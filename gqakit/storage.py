"""Everything gqakit writes to disk goes through here: files, output directories, locks and the caches.

* Files (:func:`atomic_write`) and output directories (:func:`atomic_output_dir`) are written into a
  hidden temporary sibling and renamed into place only when complete: a reader never sees half of one,
  and an interrupted run leaves the old one as it was.
* Locks (:func:`exclusive`, :func:`one_at_a_time`): one process at a time in a directory of resumable
  work or a cache entry being built. Two processes at once would write the same files, and a later resume
  could read a mix of both. A lock goes with its process (``kill -9`` leaves nothing to clean up); on a
  filesystem whose ``flock`` does not work (NFS without a lock service, some FUSE mounts: :data:`NO_LOCKS`)
  the block runs unguarded, with a warning, rather than not at all.
* The cache (:func:`cache_root`: ``$GQAKIT_CACHE`` or ``~/.cache/gqakit``) holds the assets
  (:mod:`gqakit.assets`) and two caches of copies made from a source that changes: ``.gguf`` files
  dequantized into checkpoints (:mod:`gqakit.gguf.dequantize`) and checkpoints exported to GGUF for
  llama.cpp (:mod:`gqakit.eval.llamacpp_engine`), whose rules are at :func:`write_record`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError

log = logging.getLogger(__name__)

if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    fcntl = None  # no shared locks: cached copies are handed out without one, and none is removed
else:
    import fcntl


# ---------------------------------------------------------------------------------------------- files


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(path: str | Path) -> str:
    """16 hex digits hashing a checkpoint directory's file names, sizes and modification times (a plain
    file's own, for a ``.gguf`` or a text file).

    Our checkpoints are written atomically (a new directory renamed into place), so any rewrite changes
    it; reading the weights to hash them would cost more than some evaluations. Files in subdirectories
    (an uptraining run's intermediate checkpoints) do not count.
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(Path(path).iterdir())
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_write(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of the file ``path`` (``.NAME.<random>.partial``, created empty) to
    write; rename it over ``path`` only on success, with the permissions of any new file."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_write(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, obj: Any) -> None:
    """``obj`` as indented JSON ending in a newline, written atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


# -------------------------------------------------------------------------------- output directories
OWNER_FILE = ".gqakit-owner"  # inside a .partial directory: "hostname pid"


def _writable_ancestor(path: Path) -> Path:
    """The nearest existing ancestor of ``path`` (the directory a mkdir would write into)."""
    p = path
    while not p.exists():
        p = p.parent
    return p


def check_output_dir(dst: Path, force: bool, src: Path | None = None) -> Path:
    """DST, resolved, once checked before any work: not SRC, inside it or containing it; not a file; empty
    unless ``force`` (replace it); in a directory that can be written."""
    dst = Path(dst).expanduser().resolve()
    if src is not None:
        src = Path(src).expanduser().resolve()
        if dst == src or src in dst.parents:
            raise GqakitError(f"Output {dst} is inside the source {src}: choose a directory outside it.")
        # Checked before "not empty": replacing DST (--force) would delete the source with it.
        if dst in src.parents:
            raise GqakitError(
                f"Output {dst} contains the source {src}: writing it replaces the whole directory, source "
                f"included. Choose a new directory that does not contain the source, e.g. "
                f"{src.parent / (src.name + '-gqa')}."
            )
    if dst.exists() and not dst.is_dir():
        raise GqakitError(f"Output {dst} exists and is a file: choose a directory path.")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise GqakitError(
            f"Output {dst} exists and is not empty: pass --force to replace it, or choose another path."
        )
    base = _writable_ancestor(dst.parent)
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise GqakitError(
            f"Cannot write the output {dst}: {base} is not a writable directory. Choose an output path "
            "in a directory you can write to."
        )
    return dst


def writable_dir(
    path: str | Path, option: str, create: bool = False, fix: str = "choose a directory you can write to"
) -> Path:
    """Check, before any work, that outputs can be written into the directory ``path`` (written later,
    not atomically); nothing is created unless ``create``. ``option`` names where it came from, ``fix``
    what to do instead, for the message."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise GqakitError(f"{option} {path} is a file: give a directory.")
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=".write-test.", dir=_writable_ancestor(out)))
        probe.rmdir()
    except OSError as e:
        raise GqakitError(f"{option} {path} cannot be written ({e.strerror}): {fix}.") from None
    return out


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _owner_alive(partial: Path) -> bool | None:
    """Whether the process that wrote ``partial`` still runs: True/False on this host, None when the
    partial names no owner or another host (a shared filesystem)."""
    try:
        host, pid = (partial / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return None
    if host != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def clean_stale_partials(dst: Path) -> list[Path]:
    """Remove the temporary directories of earlier runs into ``dst`` whose process is gone; report, with
    their size and the command that removes them, those whose owner cannot be told. Return the removed."""
    removed = []
    for partial in sorted(dst.parent.glob(f".{dst.name}.*.partial")) + sorted(
        dst.parent.glob(f".{dst.name}.*.old")
    ):
        alive = _owner_alive(partial)
        size = _du(partial) / 2**30
        if alive is False:
            shutil.rmtree(partial, ignore_errors=True)
            removed.append(partial)
            log.warning("removed %s (%.2f GiB), left by an interrupted run into %s", partial, size, dst)
        elif alive is None:
            log.warning(
                "%s (%.2f GiB) looks like what an interrupted run into %s left; if no run is writing it, "
                "remove it: rm -rf %s",
                partial, size, dst, partial,
            )  # fmt: skip
    return removed


def _owned_tmp_dir(dst: Path, suffix: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=suffix, dir=dst.parent))
    (tmp / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    return tmp


@contextmanager
def atomic_output_dir(dst: Path, force: bool = False, src: Path | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst`` (:func:`check_output_dir` first) to write into; rename it to
    ``dst`` only on success. On any exception (bad input, Ctrl-C, a full disk) it is removed and ``dst``
    is left as it was; with ``force``, an existing ``dst`` is replaced only once the new one is complete.

    A run killed with ``kill -9`` cannot clean up after itself: its ``.partial`` directory records its
    process, and the next run into the same DST removes it once that process is gone
    (:func:`clean_stale_partials`).
    """
    dst = check_output_dir(dst, force, src)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_partials(dst)
        tmp = _owned_tmp_dir(dst, ".partial")
    except OSError as e:  # a read-only parent: permissions (EACCES), a read-only filesystem, sysfs...
        raise GqakitError(
            f"Cannot write the output {dst}: {e.strerror} ({e.filename}). Choose an output path in a "
            "directory you can write to."
        ) from None
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the result looks like any new directory
    try:
        yield tmp
        (tmp / OWNER_FILE).unlink()
        if dst.exists():
            old = _owned_tmp_dir(dst, ".old")
            os.rename(dst, old / "x")
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------- locks
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


# ---------------------------------------------------------------------------------------------- cache


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$GQAKIT_CACHE``, else ``~/.cache/gqakit``; refused when it is a file."""
    chosen = cache_dir or os.environ.get("GQAKIT_CACHE") or Path.home() / ".cache" / "gqakit"
    root = Path(chosen).expanduser().resolve()
    if root.exists() and not root.is_dir():
        source = (
            "--cache-dir" if cache_dir else ("GQAKIT_CACHE" if os.environ.get("GQAKIT_CACHE") else "cache")
        )
        raise GqakitError(
            f"The asset cache {root} ({source}) is a file, not a directory: point --cache-dir or "
            "GQAKIT_CACHE at a directory."
        )
    return root


def writable_cache(root: Path) -> Path:
    """``root``, created if needed; a clear error when it cannot be written."""
    fix = "pass --cache-dir DIR or set GQAKIT_CACHE to a writable directory"
    return writable_dir(root, "The asset cache", create=True, fix=fix)


@contextmanager
def building(lock_file: Path, what: str, logger: logging.Logger = log) -> Iterator[None]:
    """Hold ``lock_file`` while this process builds ``what`` into the cache; a second process asking for
    the same thing waits (saying so once) and then finds it built, instead of building it over the first."""

    def waiting(owner: str) -> None:
        logger.warning("waiting for %s, which is %s", owner, what)

    with one_at_a_time(lock_file, waiting):
        yield


# ------------------------------------------------------------------------------------- cached copies
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
