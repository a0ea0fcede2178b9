"""Everything gqakit writes to disk goes through here: files (:func:`atomic_write`) and output
directories (:func:`atomic_output_dir`), renamed into place only when complete; the cache and its
copies of a changing source (:func:`cached_copy`); a pipeline's working directory
(:func:`working_directory`). The promises: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError
from gqakit.locks import OWNER, building, exclusive

log = logging.getLogger(__name__)


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


@contextmanager
def atomic_write(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of the file ``path`` (``.NAME.<random>.partial``, created empty) to
    write; rename it over ``path`` only on success, with the permissions of any new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.partial")
    tmp.touch(exist_ok=False)  # a new file, with the permissions of any new file (the umask's)
    try:
        yield tmp
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


def _writable_ancestor(path: Path) -> Path:
    """The nearest existing ancestor of ``path`` (the directory a mkdir would write into)."""
    return next(p for p in (path, *path.parents) if p.exists())


CREATED: list[Path] = []  # directories make_dirs created in this process, outermost first


def make_dirs(path: str | Path) -> Path:
    """Create the directory ``path`` and its missing parents, recording in :data:`CREATED` each one that
    did not exist, so that a command that then fails removes those still empty (:func:`remove_new_empty`)."""
    path = Path(path).expanduser()
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    CREATED.extend(reversed(missing))
    return path


def remove_new_empty() -> None:
    """Remove, innermost first, the directories :func:`make_dirs` created that are still empty: what a
    failed command made and did not fill (``gqakit`` calls it on every failure)."""
    while CREATED:
        with contextlib.suppress(OSError):  # not empty, or gone: kept as it is
            CREATED.pop().rmdir()


_OUTPUT_FIX = "choose an output path in a directory you can write to"


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
    writable_dir(dst.parent, "The output's folder", fix=_OUTPUT_FIX)
    return dst


def unwritable(name: str, e: OSError, fix: str = "choose a directory you can write to") -> GqakitError:
    """The one refusal of a place that cannot be written: ``name`` (its option and path), the system's
    reason and ``fix``."""
    return GqakitError(f"{name} cannot be written ({e.strerror}): {fix}.")


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
            make_dirs(out)
        Path(tempfile.mkdtemp(prefix=".write-test.", dir=_writable_ancestor(out))).rmdir()
    except OSError as e:
        raise unwritable(f"{option} {path}", e, fix) from None
    return out


def partial_dir(dst: Path) -> Path:
    """The temporary directory :func:`atomic_output_dir` writes ``dst`` into (other processes of a
    distributed run write their parts there while the main process holds it)."""
    return dst.with_name(f".{dst.name}.partial")


@contextmanager
def atomic_output_dir(dst: Path, force: bool = False, src: Path | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst`` (``.NAME.partial``; :func:`check_output_dir` first) to write
    into; rename it to ``dst`` only on success. On any exception (bad input, Ctrl-C, a full disk) it is
    removed and ``dst`` is left as it was; with ``force``, an existing ``dst`` is replaced only once the new
    one is complete.

    One command at a time writes ``dst`` (:func:`gqakit.locks.exclusive` on ``.NAME.partial.lock``; a
    second is refused), so a ``.partial`` or ``.old`` sibling found under the lock is what a run killed
    with ``kill -9`` left, which cannot clean up after itself: it is removed.
    """
    dst = check_output_dir(dst, force, src)
    tmp, old = partial_dir(dst), dst.with_name(f".{dst.name}.old")
    busy = f"Output {dst} is being written by another command ({OWNER}): wait for it, or choose another path."
    with ExitStack() as held:
        try:
            make_dirs(dst.parent)
            held.enter_context(exclusive(tmp.with_name(tmp.name + ".lock"), busy))
            for stale in (tmp, old):
                if stale.exists():
                    shutil.rmtree(stale)
                    log.warning("removed %s, left by an interrupted run into %s", stale, dst)
            tmp.mkdir()
        except OSError as e:  # a read-only parent: permissions (EACCES), a read-only filesystem, sysfs...
            raise unwritable(f"The output {dst}", e, _OUTPUT_FIX) from None
        try:
            yield tmp
            if dst.exists():
                os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextmanager
def working_directory(work_dir: str | Path) -> Iterator[Path]:
    """Create ``work_dir`` if needed and hold it for one pipeline run (:func:`exclusive`); yield it
    resolved."""
    work = Path(work_dir).expanduser().resolve()
    busy = (
        f"--work-dir {work} is in use by another run ({OWNER}). Two runs in one working directory would "
        "write the same checkpoints: wait for that run to finish, or pass another --work-dir."
    )
    with ExitStack() as held:
        try:  # a directory that cannot be made, or an existing one that cannot be written (the lock file)
            make_dirs(work)
            held.enter_context(exclusive(work / ".gqakit-lock", busy))
        except OSError as e:
            raise unwritable(f"--work-dir {work_dir}", e) from None
        yield work


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$GQAKIT_CACHE``, else ``~/.cache/gqakit``; refused when it is a file."""
    chosen = cache_dir or os.environ.get("GQAKIT_CACHE") or Path.home() / ".cache" / "gqakit"
    root = Path(chosen).expanduser().resolve()
    if root.exists() and not root.is_dir():
        raise GqakitError(
            f"The asset cache {root} is a file, not a directory: point --cache-dir or GQAKIT_CACHE at a "
            "directory."
        )
    return root


def writable_cache(root: Path) -> Path:
    """``root``, created if needed; a clear error when it cannot be written."""
    fix = "pass --cache-dir DIR or set GQAKIT_CACHE to a writable directory"
    return writable_dir(root, "The asset cache", create=True, fix=fix)


def source_folder(cache: str, source: Path, key: str = "") -> Path:
    """The folder of ``source``'s copies in the cache folder ``cache``: the source's name and a hash of
    its resolved path, this machine's name (a cache shared over the network holds other machines' copies,
    whose paths are theirs) and ``key``, what else the copies depend on (an export's weight type)."""
    tag = hashlib.sha256(f"{socket.gethostname()}\0{source}\0{key}".encode()).hexdigest()[:12]
    return cache_root() / cache / f"{source.name}-{tag}"


def cached_copy(
    folder: Path, name: str, build: Callable[[Path], object], what: str, log: logging.Logger
) -> Path:
    """The copy ``name`` in ``folder`` (:func:`source_folder`), found or built: a ``.gguf`` file
    dequantized into a checkpoint, a checkpoint exported to GGUF for llama.cpp. A copy is named by the
    source's fingerprint and the writer's version, so a rewritten source or a newer gqakit gets a new copy,
    never a stale one.

    ``build(copy)`` writes a missing copy atomically (a hidden temporary renamed into place), so a copy
    that exists is whole. It runs under the folder's lock (:func:`gqakit.locks.building`; ``what`` for a
    process that waits): a second process asking for a copy of the same source waits for the first's
    instead of writing its own. Under the same lock the copy's siblings then go, each removal logged with
    its size; a failed one is a warning with the command that removes it, and the command goes on. A
    hidden entry (a copy being written, the lock) is never removed.
    """
    copy = writable_cache(folder) / name
    if not copy.exists():
        with building(folder / ".lock", what.format(copy=copy), log):
            if not copy.exists():
                build(copy)
                for old in sorted(folder.iterdir()):
                    if old != copy and not old.name.startswith("."):
                        _remove(old, copy, log)
    return copy


def _remove(old: Path, current: Path, log: logging.Logger) -> None:
    """Remove the superseded copy ``old``: renamed to a hidden name first, so that a removal cut short
    leaves nothing that is handed out as a copy."""
    size = sum(f.stat().st_size for f in (old, *old.rglob("*")) if f.is_file() and not f.is_symlink())
    gone = old.with_name(f".removing-{old.name}")
    try:
        old.rename(gone)
        shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    except OSError as e:
        left = gone if gone.exists() else old
        log.warning("could not remove %s, a superseded copy: %s; remove it: rm -rf %s", old, e, left)
        return
    log.info("removed %s (%.1f MiB), superseded by %s", old, size / 2**20, current.name)
