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

Each result also records its own compute time (``compute_s``, beside ``key`` and ``value``): the time
from the lookup that missed to the ``put`` that stored it, plus the time earlier attempts under the same
key spent before they were killed (an unfinished computation saves its time every
:attr:`ResultStore.heartbeat_s` in ``.<name>.pending.json``). A report sums the times of exactly the
results it shows (:meth:`ResultStore.compute_time`), whichever run computed them; a result stored before
gqakit recorded times has none and is counted as unknown.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.storage import fingerprint, write_json

FILES = "files"  # the value field that holds an output directory's fingerprint
TIME = "compute_s"  # the record field (beside key and value) with the result's own compute time


@dataclass(frozen=True)
class ComputeTime:
    """What the results a report shows took to compute, summed over the runs that computed them.

    Attributes:
        seconds: the sum of the recorded compute times.
        results: how many results it covers.
        unknown: how many of them have no recorded time (stored before gqakit recorded compute times);
            ``seconds`` is then a lower bound.
    """

    seconds: float
    results: int
    unknown: int = 0


@dataclass
class _Attempt:
    """A result being computed: missed at ``t0`` under ``key``, not stored yet."""

    key: dict[str, Any]
    t0: float
    earlier_s: float  # what killed attempts under the same key spent on it before this run


class ResultStore:
    """JSON results under ``root``, each returned only for the key it was stored with.

    Args:
        root: the directory of the ``<name>.json`` files; created if missing.
        fresh: ignore every result stored before this run (each step recomputes and overwrites it).

    Attributes:
        reused: how many valid results this store has returned that an earlier run stored, for a
            pipeline's report (reading back this run's own results does not count).
        computed: how many results it did not have (missing, or stored for another key).
        heartbeat_s: how often the time spent on a result not stored yet is saved; a kill loses at most
            this much of it.
    """

    heartbeat_s = 30.0

    def __init__(self, root: str | Path, fresh: bool = False) -> None:
        self.root = Path(root)
        self.fresh = fresh
        self.reused = 0
        self.computed = 0
        self._written: set[str] = set()  # results this run stored: reading them back is not a reuse
        self._used: dict[str, float | None] = {}  # results this run returned or stored: their times
        self._open: dict[str, _Attempt] = {}  # results missed and not stored yet
        self._stored: list[tuple[float, float]] = []  # (start, own seconds) of the results this run stored
        self._lock = threading.Lock()  # _open and the pending files, shared with the heartbeat
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()  # the running heartbeat's
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"result name {name!r} must be a plain file stem (no '/', no leading '.')")
        return self.root / f"{name}.json"

    def _pending(self, name: str) -> Path:
        return self.root / f".{self._path(name).stem}.pending.json"

    def _lookup(self, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
        """The whole record (key, value and, since results record it, compute time), or None."""
        if self.fresh and name not in self._written:
            return None
        try:
            stored = json.loads(self._path(name).read_text())
        except (OSError, json.JSONDecodeError):
            return None  # missing, or cut short by a crash: recompute
        if not isinstance(stored, dict) or stored.get("key") != key or stored.get("value") is None:
            return None
        return stored

    def _hit(self, name: str, record: dict[str, Any]) -> dict[str, Any]:
        if name not in self._written:
            self.reused += 1
        spent = record.get(TIME)
        self._used[name] = float(spent) if isinstance(spent, int | float) else None  # None: stored before
        return record["value"]

    def _miss(self, name: str, key: dict[str, Any]) -> None:
        """Count the miss and start timing the result's computation (unless already timing it)."""
        self.computed += 1
        with self._lock:
            if name in self._open and self._open[name].key == key:
                return
            # a fresh run starts every computation over: earlier attempts are not its
            earlier = 0.0 if self.fresh else (self._pending_time(name, key) or 0.0)
            self._open[name] = _Attempt(key, time.perf_counter(), earlier)
            self._save_pending(name)
            if self._heartbeat is None:
                self._stop = threading.Event()
                self._heartbeat = threading.Thread(
                    target=self._beat, args=(self._stop,), name="gqakit-store", daemon=True
                )
                self._heartbeat.start()

    def _pending_time(self, name: str, key: dict[str, Any]) -> float | None:
        """The time earlier attempts under ``key`` saved for ``name`` before they stopped, or None."""
        try:
            pending = json.loads(self._pending(name).read_text())
            return float(pending[TIME]) if pending["key"] == key else None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # none, another key's, or cut short by the kill

    def _spent(self, a: _Attempt) -> tuple[float, float]:
        """(this run's time on ``a``, its total with the earlier attempts), less the results computed
        inside it (a step that stores other results on its way must not count their time twice)."""
        now = time.perf_counter()
        inside = sum(own for t0, own in self._stored if t0 >= a.t0)  # stored since it began
        inside += sum(now - b.t0 for b in self._open.values() if b is not a and b.t0 > a.t0)  # still open
        own = max(0.0, now - a.t0 - inside)
        return own, a.earlier_s + own

    def _save_pending(self, name: str) -> None:
        a = self._open[name]
        write_json(self._pending(name), {"key": a.key, TIME: self._spent(a)[1]})

    def _beat(self, stop: threading.Event) -> None:
        """Save the time of every result still being computed, every ``heartbeat_s``, until none is or
        :meth:`close` stops it."""
        while not stop.wait(self.heartbeat_s):
            with self._lock:
                if stop.is_set():  # closed: close() has let go of this thread
                    return
                if not self._open:  # nothing to time: the next miss starts another heartbeat
                    self._heartbeat = None
                    return
                self._save_all_pending()

    def _save_all_pending(self) -> None:
        for name in self._open:
            try:
                self._save_pending(name)
            except OSError:
                pass  # a full disk must not end the heartbeat or hide the error being raised

    def close(self) -> None:
        """Stop timing the results not stored yet (a step that raised, or a run interrupted): their time
        so far stays in their pending files, for the next attempt under the same key to add, and the
        heartbeat stops (it would otherwise count time in which nothing is computed, e.g. in a notebook
        after a failed run). The store stays usable; a pipeline closes it by ``with ResultStore(...)``."""
        with self._lock:
            self._save_all_pending()
            self._open.clear()
            self._stop.set()
            thread, self._heartbeat = self._heartbeat, None
        if thread is not None:
            thread.join()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        with its compute time: since the lookup of ``name`` under ``key`` missed, plus what killed
        attempts under the same key spent (none is recorded for a result stored without a miss)."""
        path = self._path(name)
        record: dict[str, Any] = {"key": key, "value": value}
        with self._lock:
            attempt = self._open.pop(name, None)
            if attempt is not None and attempt.key == key:
                own, record[TIME] = self._spent(attempt)
                self._stored.append((attempt.t0, own))
            elif attempt is None and not self.fresh:
                # no attempt open (the store was closed while computing it): the time saved so far
                earlier = self._pending_time(name, key)
                if earlier is not None:
                    record[TIME] = earlier
            write_json(path, record)
            self._pending(name).unlink(missing_ok=True)
        self._written.add(name)
        self._used[name] = record.get(TIME)

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
        """The compute time recorded with ``name``, a result this run returned or stored; None when it
        has none (stored before gqakit recorded times) or this run has not used it."""
        return self._used.get(name)

    def compute_time(self, names: Iterable[str] | None = None) -> ComputeTime:
        """What the results this run used (returned or stored) took to compute, for its report: each
        result's own recorded time, whether this run or an earlier one computed it, so a cached re-run,
        a resumed one and one whose settings changed but reuse results all report the same figure for
        the same results.

        Args:
            names: only these results (those of them this run used); default every one it used.
        """
        wanted = None if names is None else set(names)
        times = [t for n, t in self._used.items() if wanted is None or n in wanted]
        known = [t for t in times if t is not None]
        return ComputeTime(sum(known), len(times), len(times) - len(known))

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


__all__ = ["ComputeTime", "ResultStore", "fingerprint"]
