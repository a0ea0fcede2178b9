"""A pipeline's results on disk, each valid only for the key it was computed with.

A step that takes minutes (a conversion, an evaluation, an uptraining run) stores what it produced as
``root/<name>.json`` = ``{"key": ..., "value": ...}``. The key holds everything the result depends
on: the settings, and the :func:`fingerprint` of every checkpoint the step read. A later run asks for
the same name with its own key; a different key (changed settings, a rebuilt input) is a miss and the
step runs again. So a second run reuses whatever is still valid, and an interrupted one resumes at the
first step whose result is missing::

    store = ResultStore(work / "results")
    key = {"source": fingerprint(src), "options": {"groups": 8}}
    store.build_once(dst, key, lambda: convert(src, dst, opts))  # skipped while dst is what key built
    value = store.get("eval-" + dst.name, key)  # None: measure, then store.put("eval-...", key, value)

A step whose product is a directory (a checkpoint) records the directory's fingerprint with its value
(:meth:`ResultStore.put_output`); :meth:`ResultStore.get_output` hits only while the directory is
unchanged, so a checkpoint rewritten or deleted by hand is rebuilt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gqakit.files import fingerprint

FILES = "files"  # the value field that holds an output directory's fingerprint


class ResultStore:
    """JSON results under ``root``, each returned only for the key it was stored with.

    Args:
        root: the directory of the ``<name>.json`` files; created if missing.
        fresh: ignore every result stored before this run (each step recomputes and overwrites it).

    Attributes:
        reused: how many valid results this store has returned that an earlier run stored, for a
            pipeline's report (reading back this run's own results does not count).
        computed: how many results it did not have (missing, or stored for another key).
    """

    def __init__(self, root: str | Path, fresh: bool = False) -> None:
        self.root = Path(root)
        self.fresh = fresh
        self.reused = 0
        self.computed = 0
        self._written: set[str] = set()  # results this run stored: reading them back is not a reuse
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"result name {name!r} must be a plain file stem (no '/', no leading '.')")
        return self.root / f"{name}.json"

    def _lookup(self, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
        if self.fresh and name not in self._written:
            return None
        try:
            stored = json.loads(self._path(name).read_text())
        except (OSError, json.JSONDecodeError):
            return None  # missing, or cut short by a crash: recompute
        if not isinstance(stored, dict) or stored.get("key") != key:
            return None
        return stored.get("value")

    def get(self, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
        """The value stored under ``name`` if it was computed with ``key``, else None.

        Args:
            name: the result's file stem, e.g. ``eval-mqa-mean``.
            key: everything the value depends on, JSON-serializable; compared for equality.
        """
        value = self._lookup(name, key)
        if value is None:
            self.computed += 1
        elif name not in self._written:
            self.reused += 1
        return value

    def put(self, name: str, key: dict[str, Any], value: dict[str, Any]) -> None:
        """Store ``value`` under ``name`` for ``key``, atomically (a crash leaves the old file or none)."""
        path = self._path(name)
        tmp = self.root / f".{path.name}.tmp"
        tmp.write_text(json.dumps({"key": key, "value": value}, indent=2) + "\n")
        tmp.replace(path)
        self._written.add(name)

    def get_output(self, name: str, key: dict[str, Any], dst: str | Path) -> dict[str, Any] | None:
        """Like :meth:`get`, and only while the directory ``dst`` is the one stored with the value.

        Returns:
            The value stored by :meth:`put_output` (with its ``files`` fingerprint), or None when the
            key differs or ``dst`` is missing or was rewritten since.
        """
        value = self._lookup(name, key)
        dst = Path(dst)
        if value is None or not dst.is_dir() or fingerprint(dst) != value.get(FILES):
            self.computed += 1
            return None
        if name not in self._written:
            self.reused += 1
        return value

    def put_output(
        self, name: str, key: dict[str, Any], dst: str | Path, value: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Store ``value`` for ``key`` together with the fingerprint of the directory ``dst`` just built.

        Returns:
            The stored value: ``value`` plus ``files``, the fingerprint of ``dst``.
        """
        stored = {**(value or {}), FILES: fingerprint(dst)}
        self.put(name, key, stored)
        return stored

    def compute_time(self, key: dict[str, Any], elapsed_s: float) -> float:
        """The wall time the figures of a run took to compute, for its report: a run that computed
        everything, its own ``elapsed_s``; a run that reused everything, the time stored by the run that
        computed them (a cached re-run takes seconds); a run that did some of both, the stored time
        plus its own. Stored under ``key`` (the run's settings) for the next run."""
        stored = self._lookup("wall-time", key) if self.reused else None
        if stored is not None and not self.computed:
            return float(stored["compute_s"])
        total = elapsed_s + (float(stored["compute_s"]) if stored else 0.0)
        self.put("wall-time", key, {"compute_s": total})
        return total

    def build_once(
        self, dst: str | Path, key: dict[str, Any], build: Callable[[], object], name: str | None = None
    ) -> bool:
        """Run ``build`` (which writes the directory ``dst`` atomically) unless ``dst`` was built from the
        same ``key`` and is untouched since.

        Args:
            dst: the directory ``build`` writes.
            key: everything the build depends on (typically its inputs' fingerprints and its options).
            build: writes ``dst``; its return value is ignored.
            name: the result's name; default ``checkpoint-<dst's name>``.

        Returns:
            True when ``build`` ran, False when ``dst`` was reused.
        """
        dst = Path(dst)
        name = name or "checkpoint-" + dst.name
        if self.get_output(name, key, dst) is not None:
            return False
        build()
        self.put_output(name, key, dst)
        return True


__all__ = ["ResultStore", "fingerprint"]
