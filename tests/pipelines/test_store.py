"""The pipelines' result store: a result is returned only for the key it was stored with, and a built
checkpoint only while its directory is unchanged."""

from __future__ import annotations

import json
import os
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


def test_get_with_a_directory_follows_the_directory_it_was_stored_with(tmp_path):
    store = ResultStore(tmp_path / "results")
    out = _checkpoint(tmp_path / "uptrained")
    stored = store.put("uptrain-x", {"recipe": 1}, {"steps": 3}, out)
    assert stored == {"steps": 3, "files": fingerprint(out)}
    assert store.get("uptrain-x", {"recipe": 1}, out) == stored
    assert store.get("uptrain-x", {"recipe": 2}, out) is None
    st = (out / "model.safetensors").stat()
    os.utime(out / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same size, newer
    assert store.get("uptrain-x", {"recipe": 1}, out) is None
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
    store = ResultStore(root)
    for name in names:
        _step(store, name, **kw)
    return store


def test_each_result_records_its_compute_time_and_a_report_sums_the_results_it_shows(tmp_path):
    root = tmp_path / "results"
    first = _run(root, ["a", "b", "c"]).compute_time()
    assert 3 * STEP_S <= first < 3 * STEP_S + 0.5
    stored = json.loads((root / "a.json").read_text())
    assert set(stored) == {"key", "value", "compute_s"} and stored["compute_s"] >= STEP_S

    # a cached re-run reports the same figure, not its own seconds
    assert _run(root, ["a", "b", "c"]).compute_time() == first
    # a re-run that recomputes one result counts it once, however often it happens
    for _ in range(3):
        (root / "b.json").unlink()
        again = _run(root, ["a", "b", "c"]).compute_time()
        assert 3 * STEP_S <= again < 3 * STEP_S + 0.5
    # changed settings that reuse a and b and compute a new d: a's and b's times, and d's
    changed = _run(root, ["a", "b", "d"]).compute_time()
    assert 3 * STEP_S <= changed < 3 * STEP_S + 0.5
    # each result's own time, as recorded
    store = _run(root, ["a", "b", "c"])
    assert store.time_of("a") == stored["compute_s"]


def test_a_run_killed_between_steps_keeps_the_time_of_the_results_it_stored(tmp_path):
    root = tmp_path / "results"
    store = ResultStore(root)
    with pytest.raises(KeyboardInterrupt):
        _step(store, "a")
        _step(store, "b")
        raise KeyboardInterrupt  # killed in step c
    resumed = _run(root, ["a", "b", "c"]).compute_time()
    assert 3 * STEP_S <= resumed < 3 * STEP_S + 0.5
    assert sorted(p.name for p in root.iterdir()) == ["a.json", "b.json", "c.json"]  # nothing else


def test_a_result_killed_mid_computation_counts_the_attempt_that_stored_it(tmp_path):
    root = tmp_path / "results"
    killed = ResultStore(root)
    assert killed.get("run-x", {"run": "x"}) is None
    time.sleep(STEP_S)  # killed here: nothing of it is kept
    assert list(root.iterdir()) == []
    store = _run(root, ["run-x"])
    assert STEP_S <= store.time_of("run-x") < 2 * STEP_S


def test_results_stored_without_their_time_are_computed_again(tmp_path):
    root = tmp_path / "results"
    root.mkdir()
    key = {"step": "old", "setting": 0}
    (root / "old.json").write_text(json.dumps({"key": key, "value": {"figure": 1.0}}))  # gqakit < 0.1.0
    store = _run(root, ["old", "new"])
    assert store.reused == 0 and 2 * STEP_S <= store.compute_time() < 2 * STEP_S + 0.3
    assert "compute_s" in json.loads((root / "old.json").read_text())


def test_the_wall_time_sentence_gives_the_figures_time_beside_a_cached_runs_own():
    from gqakit.pipelines.steps import wall_time

    # a fresh run's report gives its own time only; a cached one the figures' beside it
    assert wall_time(100.0, 0, 99.0) == "1.7 min (0 results reused from the working directory)"
    assert wall_time(3.0, 5, 99.0).endswith("; the runs that computed these figures took 1.6 min")


def test_results_computed_inside_or_across_another_are_counted_once(tmp_path):
    """The time of a result computed while another is (nested, or overlapping) is that result's, not
    both: the report's sum is the wall time."""
    store = ResultStore(tmp_path / "overlap")
    store.get("a", {"k": 1})
    time.sleep(STEP_S)
    store.get("b", {"k": 1})  # b starts while a is computing, and outlasts it
    time.sleep(STEP_S)
    store.put("a", {"k": 1}, {"v": 1})
    time.sleep(STEP_S)
    store.put("b", {"k": 1}, {"v": 1})
    assert 3 * STEP_S <= store.compute_time() < 3 * STEP_S + 0.3  # not 4 (b's overlap twice)
