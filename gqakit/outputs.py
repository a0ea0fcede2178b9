"""Output directories written atomically: checked before any work, complete or absent, never orphaned.

A conversion (or an asset build) writes into a hidden temporary sibling of DST,
``.DST.<random>.partial``, and renames it to DST only when everything is written. The checks a user can
fail (DST inside the source or containing it, DST a file, DST not empty without ``--force``, a parent
that cannot be written) run when the directory is claimed, before any expensive work. A run killed with
``kill -9`` cannot clean up after itself: its ``.partial`` directory records the process that owns it,
and the next run into the same parent removes partials of the same DST whose process is gone (and
reports those it cannot attribute, with their size and the command that removes them).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gqakit.errors import GqakitError

log = logging.getLogger(__name__)
OWNER_FILE = ".gqakit-owner"  # inside a .partial directory: "hostname pid"


def _writable_ancestor(path: Path) -> Path:
    """The nearest existing ancestor of ``path`` (the directory a mkdir would write into)."""
    p = path
    while not p.exists():
        p = p.parent
    return p


def check_output_dir(dst: Path, force: bool, src: Path | None = None) -> Path:
    """Check an output directory before any work is done.

    Args:
        dst: the output directory.
        force: whether a non-empty DST may be replaced.
        src: the source checkpoint directory, when there is one.

    Returns:
        DST, resolved.

    Raises:
        GqakitError: DST is SRC, inside SRC or contains SRC; DST is a file; DST is not empty and
            ``force`` is false; or DST's parent cannot be written.
    """
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


def writable_dir(path: str | Path, option: str) -> Path:
    """Check, before any work, that outputs can be written into the directory ``path`` (written later,
    not atomically); nothing is created. ``option`` names where it came from, for the message."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise GqakitError(f"{option} {path} is a file: give a directory.")
    try:
        probe = Path(tempfile.mkdtemp(prefix=".write-test.", dir=_writable_ancestor(out)))
        probe.rmdir()
    except OSError as e:
        raise GqakitError(
            f"{option} {path} cannot be written ({e.strerror}): choose a directory you can write to."
        ) from None
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
                partial,
                size,
                dst,
                partial,
            )
    return removed


@contextmanager
def atomic_output_dir(dst: Path, force: bool = False, src: Path | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst`` to write into; rename it to ``dst`` only on success.

    On any exception (bad input, Ctrl-C, a full disk) the temporary directory is removed and ``dst``
    is left as it was. With ``force``, an existing ``dst`` is replaced only once the new one is complete.
    """
    dst = check_output_dir(dst, force, src)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_partials(dst)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    except OSError as e:  # a read-only parent: permissions (EACCES), a read-only filesystem, sysfs...
        raise GqakitError(
            f"Cannot write the output {dst}: {e.strerror} ({e.filename}). Choose an output path in a "
            "directory you can write to."
        ) from None
    (tmp / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should look like any new directory
    try:
        yield tmp
        (tmp / OWNER_FILE).unlink()
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
            (old / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")
            os.rename(dst, old / "x")
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
