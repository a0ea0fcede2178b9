"""gqakit.cache_copies: when a copy's record says a newer copy supersedes it, and how a copy handed out
is held in use (the caches that use it, dequantized GGUF copies and llama.cpp's exports, are tested with
them, another process holding a copy among them)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from gqakit import cache_copies
from gqakit.cache_copies import CopyKind, remove_superseded, superseded_by_record, use_file, write_record
from gqakit.errors import GqakitError

CURRENT = {"source": "/models/m", "fingerprint": "bbbb", "out_type": "f16", "v": 3}


@pytest.mark.parametrize(
    ("record", "superseded"),
    [
        ({**CURRENT, "fingerprint": "aaaa"}, True),  # the source changed since
        ({**CURRENT, "v": 2}, True),  # an older writer
        ({**CURRENT, "v": 2, "fingerprint": "aaaa"}, True),
        (CURRENT, False),  # the same copy (written again)
        ({**CURRENT, "fingerprint": "aaaa", "v": 4}, False),  # a newer writer's: left to it
        ({**CURRENT, "fingerprint": "aaaa", "source": "/other/m"}, False),  # another source
        ({**CURRENT, "fingerprint": "aaaa", "out_type": "f32"}, False),  # another key differs
        ({**CURRENT, "fingerprint": "aaaa", "v": "2"}, False),  # a version that is not a number
        ({k: v for k, v in CURRENT.items() if k != "v"}, False),  # no version
        (["not", "an", "object"], False),
    ],
)
def test_a_record_supersedes_by_source_fingerprint_and_version(tmp_path, record, superseded):
    (tmp_path / "source.json").write_text(json.dumps(record))
    assert superseded_by_record(tmp_path / "source.json", CURRENT, "v", lambda: True) is superseded


def test_a_missing_record_asks_the_caches_rule_and_an_unreadable_one_keeps_its_copy(tmp_path):
    path = tmp_path / "source.json"
    assert superseded_by_record(path, CURRENT, "v", lambda: True) is True
    assert superseded_by_record(path, CURRENT, "v", lambda: False) is False
    path.write_text("{not json")
    assert superseded_by_record(path, CURRENT, "v", lambda: True) is False
    path.write_bytes(b"\xff\xfe")
    assert superseded_by_record(path, CURRENT, "v", lambda: True) is False
    write_record(tmp_path / "copy" / "source.json", CURRENT)  # its folder made as needed
    assert json.loads((tmp_path / "copy" / "source.json").read_text()) == CURRENT


def _copy(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _complete(copy: Path) -> bool:
    return (copy / "config.json").is_file()


def _kind(removed: list[Path]) -> CopyKind:
    def remove(copy: Path) -> int:
        removed.append(copy)
        shutil.rmtree(copy)
        return 0

    return CopyKind(("copy", "copies"), "a copy", logging.getLogger("test"), remove, lambda c: f"rm -rf {c}")


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_copy_is_held_once_per_process_and_let_go_when_its_source_has_a_newer_one(tmp_path):
    old = _copy(tmp_path / "cache" / "m-aaaa")
    assert cache_copies.in_use(lambda: old, _complete) == old
    fd = cache_copies._HELD[old]
    assert cache_copies.in_use(lambda: old, _complete) == old and cache_copies._HELD[old] == fd  # reused
    new = _copy(tmp_path / "cache" / "m-bbbb")
    removed: list[Path] = []
    # this process asks for the newer copy now: its own hold on the old one does not keep it
    assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [old] == removed
    assert old not in cache_copies._HELD and not use_file(old).exists()


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_reader_that_races_a_removal_takes_the_copy_written_anew(tmp_path):
    """The removal holds the copy's .use file while it removes the copy: a reader that opened that file
    waits, then finds it unlinked and the copy gone, and asks for the copy again (written anew)."""
    import fcntl

    copy = _copy(tmp_path / "cache" / "m-aaaa")
    asked: list[int] = []

    def get() -> Path:
        asked.append(1)
        if len(asked) > 1 and not _complete(copy):
            _copy(copy)  # written anew, as dequantized_gguf would
        return copy

    remover = os.open(use_file(copy), os.O_RDWR | os.O_CREAT)
    fcntl.flock(remover, fcntl.LOCK_EX)
    got: list[Path] = []
    reader = threading.Thread(target=lambda: got.append(cache_copies.in_use(get, _complete)))
    reader.start()
    time.sleep(0.5)  # the reader waits for the removal's lock
    assert asked == [1] and not got
    shutil.rmtree(copy)
    use_file(copy).unlink()
    os.close(remover)
    reader.join(timeout=10)
    assert got == [copy] and len(asked) == 2 and _complete(copy)
    # and it holds the new .use file: a removal now keeps the copy
    new = _copy(tmp_path / "cache" / "m-bbbb")
    fd = os.open(use_file(copy), os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    cache_copies.release(copy)
    assert remove_superseded(_kind([]), "m", new, lambda: [copy]) == [copy]


def test_a_copy_removed_each_time_it_is_handed_out_is_an_error(tmp_path):
    gone = tmp_path / "cache" / "m-aaaa"
    with pytest.raises(GqakitError, match="removed each time it was handed out"):
        cache_copies.in_use(lambda: gone, _complete)


def test_without_flock_nothing_is_removed(tmp_path, monkeypatch):
    """Windows has no shared locks to tell which copies other processes use: superseded ones are kept."""
    old = _copy(tmp_path / "cache" / "m-aaaa")
    new = _copy(tmp_path / "cache" / "m-bbbb")
    monkeypatch.setattr(cache_copies, "fcntl", None)
    removed: list[Path] = []
    assert remove_superseded(_kind(removed), "m", new, lambda: [old]) == [] == removed
    assert _complete(old)
