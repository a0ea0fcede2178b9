"""A pipeline's results on disk, each valid only for the key it was computed with.

A step that takes minutes (a conversion, an evaluation, an uptraining run) stores what it produced as
``root/<name>.json`` = ``{"key": ..., "value": ..., "compute_s": ...}``. The key holds everything the
result depends on: the settings, and the :func:`fingerprint` of every checkpoint the step read. A later
run asks for the same name with its own key; a different key (changed settings, a rebuilt input) is a
miss and the step runs again. So a second run reuses whatever is still valid, and an interrupted one
resumes at the first step whose result is missing::

    store = ResultStore(work / "results")
    key = {"source": fingerprint(src), "options": {"groups": 8}}
    store.build_once(dst, key, lambda: convert(src, dst, opts))  # skipped while dst is what key built
    value = store.value("eval-" + dst.name, key, lambda: evaluate(dst))  # measured once per key

A step whose product is a directory (a checkpoint) records the directory's fingerprint with its value
(:meth:`ResultStore.put_output`); :meth:`ResultStore.get_output` hits only while the directory is
unchanged, so a checkpoint rewritten or deleted by hand is rebuilt.

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
from collections.abc import Callable, Iterable
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

    def _lookup(self, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
        """The whole record (key, value and compute time), or None."""
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
        return stored

    def _hit(self, name: str, record: dict[str, Any]) -> dict[str, Any]:
        if name not in self._written:
            self.reused += 1
        self._used[name] = float(record[TIME])
        return record["value"]

    def _miss(self, name: str, key: dict[str, Any]) -> None:
        """Start timing the result's computation (unless already timing it under ``key``)."""
        if name not in self._open or self._open[name][0] != key:
            self._open[name] = (key, time.perf_counter())

    def get(self, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
        """The value stored under ``name`` if it was computed with ``key``, else None.

        Args:
            name: the result's file stem, e.g. ``eval-mqa-mean``.
            key: everything the value depends on, JSON-serializable; compared for equality.
        """
        record = self._lookup(name, key)
        if record is None:
            self._miss(name, key)
            return None
        return self._hit(name, record)

    def put(self, name: str, key: dict[str, Any], value: dict[str, Any]) -> None:
        """Store ``value`` under ``name`` for ``key``, atomically (a crash leaves the old file or none),
        with its compute time: since the lookup of ``name`` under ``key`` missed, less the results
        computed inside it (a step that stores other results on its way must not count them twice)."""
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

    def value(self, name: str, key: dict[str, Any], compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The value stored under ``name`` for ``key``, else ``compute()``, stored."""
        cached = self.get(name, key)
        if cached is None:
            cached = compute()
            self.put(name, key, cached)
        return cached

    def get_output(self, name: str, key: dict[str, Any], dst: str | Path) -> dict[str, Any] | None:
        """Like :meth:`get`, and only while the directory ``dst`` is the one stored with the value.

        Returns:
            The value stored by :meth:`put_output` (with its ``files`` fingerprint), or None when the
            key differs or ``dst`` is missing or was rewritten since.
        """
        record = self._lookup(name, key)
        dst = Path(dst)
        if record is None or not dst.is_dir() or fingerprint(dst) != record["value"].get(FILES):
            self._miss(name, key)
            return None
        return self._hit(name, record)

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

    def time_of(self, name: str) -> float | None:
        """The compute time recorded with ``name``, a result this run returned or stored, else None."""
        return self._used.get(name)

    def compute_time(self, names: Iterable[str] | None = None) -> float:
        """What the results this run used (returned or stored) took to compute, for its report: each
        result's own recorded time, whether this run or an earlier one computed it, so a cached re-run
        and one whose settings changed but reuse results report the same figure for the same results.

        Args:
            names: only these results (those of them this run used); default every one it used.
        """
        wanted = None if names is None else set(names)
        return sum(t for n, t in self._used.items() if wanted is None or n in wanted)

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
