"""Everything gqakit writes to disk goes through here: files, output directories and the cache root.

* Files (:func:`atomic_write`) and output directories (:func:`atomic_output_dir`) are written into a
  hidden temporary sibling and renamed into place only when complete: a reader never sees half of one,
  and an interrupted run leaves the old one as it was.
* The cache (:func:`cache_root`: ``$GQAKIT_CACHE`` or ``~/.cache/gqakit``) holds the assets
  (:mod:`gqakit.assets`) and two caches of copies made from a source that changes: ``.gguf`` files
  dequantized into checkpoints (:mod:`gqakit.gguf.dequantize`) and checkpoints exported to GGUF for
  llama.cpp (:mod:`gqakit.eval.llamacpp_engine`), whose rules are at
  :func:`gqakit.cached_copies.write_record`.

The locks are in :mod:`gqakit.locks`, the caches of copies in :mod:`gqakit.cached_copies`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError

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
