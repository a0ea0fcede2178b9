"""Everything gqakit writes to disk goes through here: files, output directories and the cache root.

* Files (:func:`atomic_write`) and output directories (:func:`atomic_output_dir`) are written into a
  hidden temporary sibling and renamed into place only when complete: a reader never sees half of one,
  and an interrupted run leaves the old one as it was.
* The cache (:func:`cache_root`: ``$GQAKIT_CACHE`` or ``~/.cache/gqakit``) holds the assets
  (:mod:`gqakit.assets`) and two caches of copies made from a source that changes: ``.gguf`` files
  dequantized into checkpoints (:mod:`gqakit.gguf.dequantize`) and checkpoints exported to GGUF for
  llama.cpp (:mod:`gqakit.eval.llamacpp_engine`), whose rules are at
  :func:`gqakit.cached_copies.cached_copy`.
* A pipeline's working directory (:func:`working_directory`) is held by one run at a time.

The locks are in :mod:`gqakit.locks`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError
from gqakit.locks import OWNER, exclusive

log = logging.getLogger(__name__)


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
def _writable_ancestor(path: Path) -> Path:
    """The nearest existing ancestor of ``path`` (the directory a mkdir would write into)."""
    p = path
    while not p.exists():
        p = p.parent
    return p


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
            make_dirs(out)
        probe = Path(tempfile.mkdtemp(prefix=".write-test.", dir=_writable_ancestor(out)))
        probe.rmdir()
    except OSError as e:
        raise GqakitError(f"{option} {path} cannot be written ({e.strerror}): {fix}.") from None
    return out


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
    tmp, old = dst.with_name(f".{dst.name}.partial"), dst.with_name(f".{dst.name}.old")
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
            raise GqakitError(
                f"Cannot write the output {dst}: {e.strerror} ({e.filename}). Choose an output path in a "
                "directory you can write to."
            ) from None
        try:
            yield tmp
            if dst.exists():
                os.rename(dst, old)
                os.rename(tmp, dst)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


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
            make_dirs(work)
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
