"""The pipelines' result store: a result is returned only for the key it was stored with, and a built
checkpoint only while its directory is unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gqakit.pipelines.store import ResultStore, fingerprint


def _checkpoint(path: Path, weights: bytes = b"0123") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"num_key_value_heads": 2}')
    (path / "model.safetensors").write_bytes(weights)
    return path


class Builder:
    """A build step that writes ``dst`` and counts how often it ran."""

    def __init__(self, dst: Path) -> None:
        self.dst = dst
        self.runs = 0

    def __call__(self) -> None:
        self.runs += 1
        _checkpoint(self.dst, b"built %d" % self.runs)


def test_a_result_comes_back_only_for_its_key(tmp_path):
    store = ResultStore(tmp_path / "results")
    key = {"files": "abc", "seq_len": 512}
    assert store.get("eval-m", key) is None
    store.put("eval-m", key, {"ppl": 15.9})
    assert store.get("eval-m", key) == {"ppl": 15.9}
    assert store.get("eval-m", {**key, "seq_len": 256}) is None  # a changed setting is a miss
    assert store.get("eval-other", key) is None
    assert store.reused == 0  # its own result read back: not a reuse (a fresh run's report says 0)
    # A later run (a new store on the same directory) reuses it; a fresh one does not, until it has
    # stored the result itself.
    later = ResultStore(tmp_path / "results")
    assert later.get("eval-m", key) == {"ppl": 15.9} and later.reused == 1
    fresh = ResultStore(tmp_path / "results", fresh=True)
    assert fresh.get("eval-m", key) is None
    fresh.put("eval-m", key, {"ppl": 16.0})
    assert fresh.get("eval-m", key) == {"ppl": 16.0} and fresh.reused == 0


def test_a_truncated_result_file_is_a_miss_and_put_replaces_it(tmp_path):
    store = ResultStore(tmp_path)
    (tmp_path / "eval-m.json").write_text('{"key": {"a": 1}, "val')  # a crash mid-write, by hand
    assert store.get("eval-m", {"a": 1}) is None
    store.put("eval-m", {"a": 1}, {"ppl": 2.0})
    assert store.get("eval-m", {"a": 1}) == {"ppl": 2.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval-m.json"]  # no temporary file left


@pytest.mark.parametrize("name", ["", "a/b", "../x", ".hidden"])
def test_a_result_name_must_be_a_plain_file_stem(tmp_path, name):
    with pytest.raises(ValueError, match="plain file stem"):
        ResultStore(tmp_path).put(name, {}, {})


def test_build_once_reuses_an_untouched_checkpoint_and_rebuilds_otherwise(tmp_path):
    store = ResultStore(tmp_path / "results")
    dst = tmp_path / "models" / "mqa"
    build = Builder(dst)
    key = {"source": "f00", "options": "groups=1"}

    assert store.build_once(dst, key, build) is True and build.runs == 1
    assert store.build_once(dst, key, build) is False and build.runs == 1
    assert store.reused == 0  # what this run built itself
    store = ResultStore(tmp_path / "results")  # a later run
    assert store.build_once(dst, key, build) is False and build.runs == 1
    assert store.reused == 1

    # A changed key (other options, a rebuilt source) rebuilds.
    assert store.build_once(dst, {**key, "options": "groups=2"}, build) is True and build.runs == 2

    # A checkpoint rewritten by hand since it was built is rebuilt, even under the same key.
    (dst / "model.safetensors").write_bytes(b"edited by hand, longer")
    assert store.build_once(dst, {**key, "options": "groups=2"}, build) is True and build.runs == 3

    # So is a deleted one; a rejected check does not count as reused.
    for f in dst.iterdir():
        f.unlink()
    dst.rmdir()
    assert store.build_once(dst, {**key, "options": "groups=2"}, build) is True and build.runs == 4
    assert dst.is_dir() and store.reused == 1


def test_get_output_follows_the_directory_it_was_stored_with(tmp_path):
    store = ResultStore(tmp_path / "results")
    out = _checkpoint(tmp_path / "uptrained")
    stored = store.put_output("uptrain-x", {"recipe": 1}, out, {"steps": 3})
    assert stored == {"steps": 3, "files": fingerprint(out)}
    assert store.get_output("uptrain-x", {"recipe": 1}, out) == stored
    assert store.get_output("uptrain-x", {"recipe": 2}, out) is None
    st = (out / "model.safetensors").stat()
    os.utime(out / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same size, newer
    assert store.get_output("uptrain-x", {"recipe": 1}, out) is None
    assert store.get("uptrain-x", {"recipe": 1}) == stored  # the plain lookup does not check files


def test_fingerprint_sees_names_sizes_and_times_of_top_level_files(tmp_path):
    ckpt = _checkpoint(tmp_path / "m")
    before = fingerprint(ckpt)
    assert len(before) == 16 and fingerprint(ckpt) == before
    (ckpt / "checkpoints").mkdir()
    (ckpt / "checkpoints" / "step-1.pt").write_bytes(b"x")  # an uptraining run's intermediate state
    assert fingerprint(ckpt) == before
    (ckpt / "tokenizer.json").write_text("{}")
    with_tokenizer = fingerprint(ckpt)
    assert with_tokenizer != before
    (ckpt / "tokenizer.json").rename(ckpt / "tokenizer2.json")  # same size and time, another name
    assert fingerprint(ckpt) != with_tokenizer

    single = tmp_path / "model.gguf"
    single.write_bytes(b"GGUF")
    first = fingerprint(single)
    single.write_bytes(b"GGUF v2")
    assert fingerprint(single) != first


# ---------------------------------------------------------------------------------------------------
# Compute time: each result records its own; a report sums those of the results it shows
# ---------------------------------------------------------------------------------------------------

STEP_S = 0.2  # what each fake step takes


def _step(store: ResultStore, name: str, seconds: float = STEP_S, setting: int = 0) -> None:
    """A fake pipeline step: look the result up, compute it (sleep) when missing, store it."""
    key = {"step": name, "setting": setting}
    if store.get(name, key) is None:
        time.sleep(seconds)
        store.put(name, key, {"figure": 1.0})


def _run(root: Path, names: list[str], **kw) -> ResultStore:
    """One pipeline run over ``names``; its store, to ask what the figures took."""
    with ResultStore(root) as store:
        for name in names:
            _step(store, name, **kw)
    return store


def test_each_result_records_its_compute_time_and_a_report_sums_the_results_it_shows(tmp_path):
    root = tmp_path / "results"
    first = _run(root, ["a", "b", "c"]).compute_time()
    assert first.results == 3 and first.unknown == 0
    assert 3 * STEP_S <= first.seconds < 3 * STEP_S + 0.5
    stored = json.loads((root / "a.json").read_text())
    assert set(stored) == {"key", "value", "compute_s"} and stored["compute_s"] >= STEP_S

    # a cached re-run reports the same figure, not its own seconds
    assert _run(root, ["a", "b", "c"]).compute_time() == first
    # a re-run that recomputes one result counts it once, however often it happens
    for _ in range(3):
        (root / "b.json").unlink()
        again = _run(root, ["a", "b", "c"]).compute_time()
        assert again.results == 3 and 3 * STEP_S <= again.seconds < 3 * STEP_S + 0.5
    # changed settings that reuse a and b and compute a new d: a's and b's times, and d's
    changed = _run(root, ["a", "b", "d"]).compute_time()
    assert changed.results == 3 and 3 * STEP_S <= changed.seconds < 3 * STEP_S + 0.5
    # only the results named
    store = _run(root, ["a", "b", "c"])
    assert store.compute_time(["a"]).results == 1 and store.time_of("a") == stored["compute_s"]


def test_a_run_killed_between_steps_keeps_the_time_of_the_results_it_stored(tmp_path):
    root = tmp_path / "results"
    with pytest.raises(KeyboardInterrupt), ResultStore(root) as store:
        _step(store, "a")
        _step(store, "b")
        raise KeyboardInterrupt  # killed in step c
    resumed = _run(root, ["a", "b", "c"]).compute_time()
    assert resumed.results == 3 and 3 * STEP_S <= resumed.seconds < 3 * STEP_S + 0.5


def test_a_result_killed_mid_computation_counts_the_time_before_the_kill(tmp_path):
    root = tmp_path / "results"
    # a run that is computing "run-x" when it is killed (SIGKILL: nothing of it runs after the kill)
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "computing"
        time.sleep(1.0)
    finally:
        child.kill()
        child.wait()
    pending = json.loads((root / ".run-x.pending.json").read_text())
    assert pending["key"] == {"run": "x"} and pending["compute_s"] >= 0.7  # the last heartbeat's

    with ResultStore(root) as store:  # the next run resumes it and finishes in 0.2 s
        _step(store, "other")  # its own steps before do not count towards it
        assert store.get("run-x", {"run": "x"}) is None
        time.sleep(STEP_S)
        store.put("run-x", {"run": "x"}, {"figure": 1.0})
    assert pending["compute_s"] + STEP_S <= store.time_of("run-x") < pending["compute_s"] + STEP_S + 0.3
    assert not (root / ".run-x.pending.json").exists()

    # an attempt under another key, or a --fresh run (which starts every computation over), counts none
    for fresh, key in ((False, {"run": "y"}), (True, {"run": "x"})):
        (root / ".run-x.pending.json").write_text(json.dumps({"key": {"run": "x"}, "compute_s": 100.0}))
        with ResultStore(root, fresh=fresh) as store:
            assert store.get("run-x", key) is None
            store.put("run-x", key, {"figure": 2.0})
        assert store.time_of("run-x") < 1


KILLED = """
import sys, time
from gqakit.pipelines.store import ResultStore
ResultStore.heartbeat_s = 0.05
store = ResultStore(sys.argv[1])
store.get("run-x", {"run": "x"})
print("computing", flush=True)
time.sleep(60)
"""


def test_a_step_that_raises_keeps_its_time_so_far_and_stops_timing(tmp_path, monkeypatch):
    monkeypatch.setattr(ResultStore, "heartbeat_s", 0.05)
    root = tmp_path / "results"
    with pytest.raises(RuntimeError), ResultStore(root) as store:
        store.get("run-x", {"run": "x"})
        time.sleep(STEP_S)
        raise RuntimeError("out of memory")
    assert store._heartbeat is None  # closed: no more beats, as a notebook would go on after the error
    saved = json.loads((root / ".run-x.pending.json").read_text())["compute_s"]
    time.sleep(0.2)
    assert json.loads((root / ".run-x.pending.json").read_text())["compute_s"] == saved >= STEP_S


def test_results_stored_before_times_were_recorded_count_as_unknown(tmp_path):
    from gqakit.pipelines.reporting import wall_time

    root = tmp_path / "results"
    root.mkdir()
    key = {"step": "old", "setting": 0}
    (root / "old.json").write_text(json.dumps({"key": key, "value": {"figure": 1.0}}))  # gqakit < this
    store = _run(root, ["old", "new"])
    spent = store.compute_time()
    assert (spent.results, spent.unknown) == (2, 1) and store.time_of("old") is None
    assert STEP_S <= spent.seconds < STEP_S + 0.3  # the new result's only: a lower bound
    text = wall_time(0.3, store.reused, spent.seconds, spent.unknown)
    assert text.startswith("0 s (1 results reused from the working directory); the runs that computed")
    assert "at least 0 s (1 of the results were stored by an older gqakit without their compute time" in text
    # a fresh run's report gives its own time only; a cached one the figures' beside it
    assert wall_time(100.0, 0, 99.0) == "1.7 min (0 results reused from the working directory)"
    assert wall_time(3.0, 5, 99.0).endswith("; the runs that computed these figures took 1.6 min")


def test_results_computed_inside_or_across_another_are_counted_once(tmp_path):
    """The time of a result computed while another is (nested, or overlapping) is that result's, not
    both: the report's sum is the wall time, also after a kill of both (their pending times)."""
    store = ResultStore(tmp_path / "overlap")
    store.get("a", {"k": 1})
    time.sleep(STEP_S)
    store.get("b", {"k": 1})  # b starts while a is computing, and outlasts it
    time.sleep(STEP_S)
    store.put("a", {"k": 1}, {"v": 1})
    time.sleep(STEP_S)
    store.put("b", {"k": 1}, {"v": 1})
    store.close()
    assert 3 * STEP_S <= store.compute_time().seconds < 3 * STEP_S + 0.3  # not 4 (b's overlap twice)

    root = tmp_path / "nested"
    killed = ResultStore(root)
    killed.get("outer", {"k": 1})
    time.sleep(STEP_S)
    killed.get("inner", {"k": 1})
    time.sleep(2 * STEP_S)
    killed.close()  # both pending, as a kill after the heartbeat leaves them
    again = ResultStore(root)
    for name in ("outer", "inner"):
        again.get(name, {"k": 1})
    again.put("inner", {"k": 1}, {"v": 1})
    again.put("outer", {"k": 1}, {"v": 1})
    again.close()
    spent = again.compute_time().seconds
    assert 3 * STEP_S <= spent < 3 * STEP_S + 0.3, spent  # not 5 (the inner's twice)


def test_a_result_stored_after_the_store_was_closed_keeps_the_time_saved(tmp_path):
    store = ResultStore(tmp_path / "results")
    store.get("a", {"k": 1})
    time.sleep(STEP_S)
    store.close()  # a notebook: a step raised, the with block closed the store; then the step is rerun
    store.put("a", {"k": 1}, {"v": 1})
    assert store.time_of("a") is not None and store.time_of("a") >= STEP_S
    assert store.compute_time().unknown == 0
