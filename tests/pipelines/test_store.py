"""The pipelines' result store: a result is returned only for the key it was stored with, and a built
checkpoint only while its directory is unchanged."""

from __future__ import annotations

import os
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
