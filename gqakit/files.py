"""File helpers every layer uses: content hashes, JSON files, cheap fingerprints of checkpoints, and the
gqakit cache folder (``$GQAKIT_CACHE``)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON, ending in a newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def fingerprint(path: str | Path) -> str:
    """A short hash of a checkpoint directory's file names, sizes and modification times.

    Our checkpoints are written atomically (a new directory renamed into place), so any rewrite changes
    it; reading the weights to hash them would cost more than some evaluations. Files in subdirectories
    (an uptraining run's intermediate checkpoints) do not count. A plain file (a ``.gguf``, a text
    file) is fingerprinted by its own name, size and modification time.

    Args:
        path: a directory or a file; it must exist.

    Returns:
        16 hex digits.
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(Path(path).iterdir())
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


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
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkstemp(prefix=".write-test.", dir=root)[1])
        probe.unlink()
    except OSError as e:
        raise GqakitError(
            f"The asset cache {root} cannot be written ({e.strerror}): pass --cache-dir DIR or set "
            "GQAKIT_CACHE to a writable directory."
        ) from None
    return root


__all__ = ["cache_root", "fingerprint", "sha256_file", "write_json", "writable_cache"]
