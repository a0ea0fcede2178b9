"""Rewrite the absolute paths in result files as paths relative to their run.

A result file (``results.json``, ``report.md``, a log) records the paths of the machine that wrote it:
``/work/big/demo-work/models/mha-9``, ``/root/.cache/gqakit/wiki-en/test.txt``. This script turns a path
under the asset cache into ``$GQAKIT_CACHE/...`` and a path under the folder a run was started from into
a path relative to it (``demo-work/models/mha-9``). It replaces path prefixes in the text and nothing
else, so no figure changes::

    python benchmarks/relative_paths.py benchmarks/results --cache /root/.cache/gqakit \\
        --run-dir /work/big --run-dir /tmp
    python benchmarks/relative_paths.py benchmarks/results --check   # lists what is still absolute

``--check`` exits 1 and names each file that still holds an absolute path; the tests run the same check.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

SUFFIXES = (".json", ".jsonl", ".md", ".yaml", ".yml", ".log", ".txt")
# An absolute path of a Unix machine: a root folder these machines write runs and caches under.
ABSOLUTE = re.compile(r"(?<![\w./$-])/(?:root|tmp|work|home|mnt|data|scratch|Users)/[^\s\"'`,)\]]*")
_END = r"(/|(?=[\s\"'`,)\]]|$))"  # the prefix ends at a separator or where the path ends


def result_files(root: Path) -> list[Path]:
    """The text files under ``root`` (figures and binaries are left alone)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SUFFIXES)


def absolute_paths(text: str) -> list[str]:
    """The absolute machine paths in ``text``."""
    return sorted(set(ABSOLUTE.findall(text)))


def relative_text(text: str, caches: list[str], run_dirs: list[str]) -> str:
    """``text`` with every path under a cache as ``$GQAKIT_CACHE/...`` and every path under a run folder
    relative to it; the longest prefix wins."""
    prefixes = [(c.rstrip("/"), "$GQAKIT_CACHE") for c in caches] + [(r.rstrip("/"), None) for r in run_dirs]
    for prefix, cache in sorted(prefixes, key=lambda p: -len(p[0])):
        pattern = re.compile(r"(?<![\w./$-])" + re.escape(prefix) + _END)

        def replace(m: re.Match[str], cache: str | None = cache) -> str:
            if cache is not None:
                return cache + m.group(1)
            return "" if m.group(1) == "/" else "."

        text = pattern.sub(replace, text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the results folder (benchmarks/results)")
    parser.add_argument("--cache", action="append", default=[], help="an asset cache the runs read")
    parser.add_argument("--run-dir", action="append", default=[], help="a folder runs were started from")
    parser.add_argument("--check", action="store_true", help="only list the files with absolute paths")
    args = parser.parse_args(argv)
    left = 0
    for path in result_files(args.root):
        text = path.read_text()
        if not args.check:
            new = relative_text(text, args.cache, args.run_dir)
            if new != text:
                path.write_text(new)
                print(f"rewrote {path}")
            text = new
        found = absolute_paths(text)
        if found:
            left += 1
            print(f"{path}: still absolute: {', '.join(found[:5])}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
