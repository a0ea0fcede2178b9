"""A pipeline's results on disk, each valid only for the key it was computed with.

A step that takes minutes (a conversion, an evaluation, an uptraining run) stores what it produced as
``root/<name>.json`` = ``{"key": ..., "value": ..., "compute_s": ...}``. The key holds everything the
result depends on: the settings, and the :func:`fingerprint` of every checkpoint the step read. A later
run asks for the same name with its own key; a different key (changed settings, a rebuilt input) is a
miss and the step runs again. So a second run reuses whatever is still valid, and an interrupted one
resumes at the first step whose result is missing (:meth:`ResultStore.build_once`,
:meth:`ResultStore.value`).

Each result records its own compute time (``compute_s``): from the lookup that missed to the ``put``
that stored it, less the results stored in between (counted once, as their own). A report sums the times
of exactly the results it shows (:meth:`ResultStore.compute_time`), whichever run computed them. A run
killed in the middle of a step keeps nothing of that step's time: the attempt that finishes it counts
from its own start (an uptraining run resumed from its checkpoint counts the part after the resume). A
result stored without ``compute_s`` (by a gqakit before 0.1.0) is computed again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gqakit.storage import fingerprint, make_dirs, write_json

FILES = "files"  # the value field that holds an output directory's fingerprint
TIME = "compute_s"  # the record field (beside key and value) with the result's own compute time


class ResultStore:
    """JSON results under ``root``, each returned only for the key it was stored with.

    Args:
        root: the directory of the ``<name>.json`` files; created if missing.
        fresh: ignore every result stored before this run (each step recomputes and overwrites it).

    Attributes:
        reused: how many valid results this store has returned that an earlier run stored, for a
            pipeline's report (reading back this run's own results does not count).
    """

    def __init__(self, root: str | Path, fresh: bool = False) -> None:
        self.root = Path(root)
        self.fresh = fresh
        self.reused = 0
        self._written: set[str] = set()  # results this run stored: reading them back is not a reuse
        self._used: dict[str, float] = {}  # results this run returned or stored: their compute times
        self._open: dict[str, tuple[dict[str, Any], float]] = {}  # missed, not stored yet: (key, start)
        self._stored: list[tuple[float, float]] = []  # (start, own seconds) of the results this run stored
        make_dirs(self.root)

    def _path(self, name: str) -> Path:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"result name {name!r} must be a plain file stem (no '/', no leading '.')")
        return self.root / f"{name}.json"

    def _lookup(self, name: str, key: dict[str, Any], dst: str | Path | None) -> dict[str, Any] | None:
        """The whole record (key, value and compute time), or None; with ``dst``, only while that directory
        is as it was stored."""
        if self.fresh and name not in self._written:
            return None
        try:
            stored = json.loads(self._path(name).read_text())
        except (OSError, json.JSONDecodeError):
            return None  # missing, or cut short by a crash: recompute
        if not isinstance(stored, dict) or stored.get("key") != key or stored.get("value") is None:
            return None
        if not isinstance(stored.get(TIME), int | float):
            return None  # stored before results recorded their time
        if dst is not None and (not Path(dst).is_dir() or fingerprint(dst) != stored["value"].get(FILES)):
            return None
        return stored

    def get(self, name: str, key: dict[str, Any], dst: str | Path | None = None) -> dict[str, Any] | None:
        """The value stored under ``name`` if it was computed with ``key``, else None.

        Args:
            name: the result's file stem, e.g. ``eval-mqa-mean``.
            key: everything the value depends on, JSON-serializable; compared for equality.
            dst: a directory stored with the value (:meth:`put`): a hit only while it is unchanged, so a
                checkpoint rewritten or deleted by hand is rebuilt.
        """
        record = self._lookup(name, key, dst)
        if record is None:  # start timing its computation (unless already timing it under ``key``)
            if name not in self._open or self._open[name][0] != key:
                self._open[name] = (key, time.perf_counter())
            return None
        if name not in self._written:
            self.reused += 1
        self._used[name] = float(record[TIME])
        return record["value"]

    def put(
        self, name: str, key: dict[str, Any], value: dict[str, Any], dst: str | Path | None = None
    ) -> dict[str, Any]:
        """Store ``value`` under ``name`` for ``key``, atomically (a crash leaves the old file or none),
        with its compute time: since the lookup of ``name`` under ``key`` missed, less the results
        computed inside it (a step that stores other results on its way must not count them twice). With
        ``dst``, the directory just built, its fingerprint goes with the value (as ``files``). Returns the
        value stored."""
        if dst is not None:
            value = {**value, FILES: fingerprint(dst)}
        path = self._path(name)
        now = time.perf_counter()
        missed_key, t0 = self._open.pop(name, (key, now))
        t0 = t0 if missed_key == key else now
        inside = sum(own for start, own in self._stored if start >= t0)  # stored since it began
        inside += sum(now - start for _, start in self._open.values() if start > t0)  # still open
        own = max(0.0, now - t0 - inside)
        self._stored.append((t0, own))
        write_json(path, {"key": key, "value": value, TIME: own})
        self._written.add(name)
        self._used[name] = own
        return value

    def value(self, name: str, key: dict[str, Any], compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The value stored under ``name`` for ``key``, else ``compute()``, stored."""
        cached = self.get(name, key)
        return self.put(name, key, compute()) if cached is None else cached

    def time_of(self, name: str) -> float | None:
        """The compute time recorded with ``name``, a result this run returned or stored, else None."""
        return self._used.get(name)

    def compute_time(self) -> float:
        """What the results this run used (returned or stored) took to compute, for its report: each
        result's own recorded time, whether this run or an earlier one computed it, so a cached re-run
        and one whose settings changed but reuse results report the same figure for the same results."""
        return sum(self._used.values())

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
        if self.get(name, key, dst) is not None:
            return False
        build()
        self.put(name, key, {}, dst)
        return True
