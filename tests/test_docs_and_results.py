"""Docs and result files speak to users: no commit hashes in docs/ or the README (history goes to
CHANGELOG.md), and the result files under benchmarks/results/ carry paths relative to their run, never the
absolute paths of the machine that wrote them (benchmarks/relative_paths.py rewrites them)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("relative_paths", ROOT / "benchmarks" / "relative_paths.py")
relative_paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(relative_paths)


# A git commit id as people paste it: 7 to 40 hex digits, with letters and digits both (not a number, not
# a word like "defaced"); a 64-digit sha256 of a file is not one.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_the_docs_hold_no_commit_hashes():
    found = {
        str(p.relative_to(ROOT)): COMMIT.findall(p.read_text())
        for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    }
    assert COMMIT.findall("at commit 70eb8e3, sha256 " + "ab12" * 16) == ["70eb8e3"]
    assert not {k: v for k, v in found.items() if v}, found


def test_no_result_file_holds_an_absolute_path():
    found = {
        str(p.relative_to(ROOT)): relative_paths.absolute_paths(p.read_text())
        for p in relative_paths.result_files(ROOT / "benchmarks" / "results")
    }
    found = {k: v for k, v in found.items() if v}
    assert not found, f"run `python benchmarks/relative_paths.py benchmarks/results --run-dir ...`: {found}"


def test_the_rewrite_makes_paths_relative_and_leaves_figures_alone():
    text = (
        '{"model": "/work/big/demo-work/models/mha-9", "ppl": 15.93, '
        '"data": "/root/.cache/gqakit/wiki-en/test.txt", "cwd": "/work/big", "note": "ratio 1/2"}'
    )
    got = relative_paths.relative_text(text, ["/root/.cache/gqakit"], ["/work/big"])
    assert got == (
        '{"model": "demo-work/models/mha-9", "ppl": 15.93, '
        '"data": "$GQAKIT_CACHE/wiki-en/test.txt", "cwd": ".", "note": "ratio 1/2"}'
    )
    assert relative_paths.absolute_paths(text) == [
        "/root/.cache/gqakit/wiki-en/test.txt",
        "/work/big",
        "/work/big/demo-work/models/mha-9",
    ]
    assert relative_paths.absolute_paths(got) == []
