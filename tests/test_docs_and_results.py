"""The docs against the code and the result files.

- Every command the README and docs/ show (``gqakit ...``, ``python benchmarks/X.py ...``, ``bash
  benchmarks/X.sh ...``) names a command, script and options that exist, with valid choices; a command
  that only an earlier version ran is allowed where its paragraph says so ("gqakit 0.1.0").
- Every README example runs as written on a fresh machine: each model it names is an asset or the output
  of an example before it, each shell variable is defined before it is used.
- The README's results table is the demo's result file, and docs/recovery.md's summary table the
  recovery runs' result files, figure by figure.
- benchmarks/ holds only scripts that the docs name; relative links in the README and docs/ resolve.
- No commit hashes in docs/ or the README (history goes to CHANGELOG.md); result files under
  benchmarks/results/ carry paths relative to their run, never the absolute paths of the machine that wrote
  them (benchmarks/relative_paths.py rewrites them).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest

from gqakit.cli import COMMANDS, load_command

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
EARLIER = "gqakit 0.1.0"  # a paragraph naming this version may show commands and scripts since removed

_spec = importlib.util.spec_from_file_location("relative_paths", BENCH / "relative_paths.py")
relative_paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(relative_paths)


# --- reading markdown -------------------------------------------------------------------------------


def blocks(text: str) -> list[tuple[str, bool, str]]:
    """``(block, is_code, context)`` per paragraph or fenced code block; a code block's context is itself
    and the paragraph right before it (where the words that introduce a command stand)."""
    out: list[tuple[str, bool, str]] = []
    para: list[str] = []
    code: list[str] | None = None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if code is None:
                if para:
                    out.append(("\n".join(para), False, "\n".join(para)))
                    para = []
                code = []
            else:
                prev = out[-1][0] if out and not out[-1][1] else ""
                out.append(("\n".join(code), True, prev + "\n" + "\n".join(code)))
                code = None
        elif code is not None:
            code.append(line)
        elif line.strip():
            para.append(line)
        elif para:
            out.append(("\n".join(para), False, "\n".join(para)))
            para = []
    if para:
        out.append(("\n".join(para), False, "\n".join(para)))
    return out


def command_lines(block: str, is_code: bool) -> list[str]:
    """The commands in a block: a code block's lines (continuations joined, ``&&``/``;``/``|`` split,
    comments and leading ``VAR=value`` assignments dropped), or a paragraph's inline code spans."""
    if is_code:
        joined = re.sub(r"\\\n\s*", " ", block)
        pieces = [p for line in joined.splitlines() for p in re.split(r"&&|;|\|(?!\|)", line)]
    else:
        pieces = re.findall(r"`([^`\n]+)`", block.replace("\n", " "))
    cmds = []
    for piece in pieces:
        piece = re.sub(r"(^|\s)#.*$", "", piece).strip()
        while re.match(r"^[A-Za-z_][A-Za-z0-9_]*=\S*\s", piece):  # OMP_NUM_THREADS=1 python ...
            piece = piece.split(None, 1)[1]
        if re.match(r"^(gqakit \w|python3? benchmarks/|bash benchmarks/)", piece):
            cmds.append(piece)
    return cmds


def words(cmd: str) -> list[str]:
    try:
        return shlex.split(cmd)
    except ValueError:  # an unbalanced quote in a doc's shorthand
        return cmd.split()


def documented_commands(paths: list[Path]) -> list[tuple[str, str, str]]:
    """``(file, command, context)`` for every command shown in ``paths``."""
    return [
        (p.name, cmd, context)
        for p in paths
        for block, is_code, context in blocks(p.read_text())
        for cmd in command_lines(block, is_code)
    ]


# --- checking one command -----------------------------------------------------------------------------


PIPELINES = ("demo", "recovery", "replicate")  # their --set model.convert.* sets the starts' settings


def gqakit_problems(argv: list[str]) -> list[str]:
    """What in ``gqakit ARGV`` the CLI does not take: an unknown command or option, a value outside its
    choices (``--preset``, ``--method``, ...)."""
    from gqakit.pipelines import starts

    if not argv or argv[0] not in COMMANDS:
        return [f"no command {argv[:1]}"]
    cmd: click.Command = load_command(argv[0])
    rest = argv[1:]
    if isinstance(cmd, click.Group):
        if not rest:
            return []  # the group named in prose
        if rest[0] not in cmd.commands:
            return [f"no command {argv[:2]}"]
        cmd, rest = cmd.commands[rest[0]], rest[1:]
    options = [p for p in cmd.get_params(click.Context(cmd)) if isinstance(p, click.Option)]
    params = {o: p for p in options for o in [*p.opts, *p.secondary_opts]}
    problems = []
    i = 0
    while i < len(rest):
        word = rest[i]
        i += 1
        if not word.startswith("-") or word == "-":
            continue
        name, _, value = word.partition("=")
        param = params.get(name)
        if param is None:
            problems.append(f"no option {name}")
            continue
        if param.is_flag or param.count:
            continue
        if not value and i < len(rest):
            value, i = rest[i], i + 1
        if name == "--starts":
            problems += [f"--starts {v!r} is no start" for v in value.split(",") if v not in starts.STARTS]
        if name == "--set" and value.startswith(starts.CONVERT) and argv[0] in PIPELINES:
            field = value[len(starts.CONVERT) :].partition("=")[0]
            problems += [f"--set {value}: no such setting"] if field not in starts.SETTABLE else []
        if isinstance(param.type, click.Choice) and "$" not in value:
            choices = {str(c) for c in param.type.choices}
            given = value.split(",") if param.multiple or "," in value else [value]
            problems += [f"{name} {v!r} not in {sorted(choices)}" for v in given if v not in choices]
    return problems


def script_problems(argv: list[str]) -> list[str]:
    """What in ``python benchmarks/X.py ARGS`` / ``bash benchmarks/X.sh ARGS`` does not exist."""
    script = ROOT / argv[1]
    if not script.is_file():
        return [f"no script {argv[1]}"]
    source = script.read_text()
    if script.suffix == ".sh":
        return [f"no step {w!r}" for w in argv[3:] if f"\n    {w})" not in source]  # run_gpu.sh's steps
    flags = [w.partition("=")[0] for w in argv[2:] if w.startswith("--")]
    return [f"no option {f}" for f in flags if f'"{f}"' not in source]


def problems_of(cmd: str) -> list[str]:
    argv = words(cmd)
    if argv[0] == "gqakit":
        return gqakit_problems(argv[1:])
    return script_problems(argv)


def test_every_documented_command_exists_with_its_options():
    found = {}
    for name, cmd, context in documented_commands([README, *DOCS]):
        if EARLIER in context:
            continue  # a command of an earlier version, said so
        problems = problems_of(cmd)
        if problems:
            found[f"{name}: {cmd}"] = problems
    assert not found, found


def test_the_benchmark_scripts_run_todays_commands():
    found = {}
    for script in sorted(BENCH.glob("*.sh")):
        for cmd in command_lines(script.read_text(), True):
            problems = problems_of(cmd)
            if problems:
                found[f"{script.name}: {cmd}"] = problems
    assert not found, found


def test_the_command_check_catches_a_drifted_command():
    assert problems_of("gqakit convert a b --groups 1 --preset fast") == []
    assert problems_of("gqakit convert a b --groups 1 --preset nope")
    assert problems_of("gqakit convert a b --groups 1 --refine-schedule cosine")
    assert problems_of("gqakit assets fetch wiki-en") == []
    ok = "gqakit recovery m --groups 1 --starts mean,best --set model.convert.refine_steps=9"
    assert problems_of(ok) == []
    assert problems_of("gqakit recovery m --groups 1 --starts mean,refined")
    assert problems_of("gqakit recovery m --groups 1 --set model.convert.refine_loss=relative")
    assert problems_of("gqakit uptrain r.yaml --set model.convert.preset=fast") == []
    assert problems_of("gqakit nonsense") and problems_of("gqakit assets nonsense")
    assert problems_of("python benchmarks/bench_decode.py --contexts 512") == []
    assert problems_of("python benchmarks/bench_decode.py --no-such-flag 1")
    assert problems_of("python benchmarks/layer_attribution.py X")
    assert problems_of("bash benchmarks/run_gpu.sh OUT perplexity") == []
    assert problems_of("bash benchmarks/run_gpu.sh OUT nonsense")
    text = "Measured by:\n\n```\ngqakit convert a b --no-such 1 \\\n  --groups 1\n```\n"
    [(_, cmd, context)] = [
        (b, c, ctx) for b, code, ctx in blocks(text) for c in command_lines(b, code) if code
    ]
    assert problems_of(cmd) == ["no option --no-such"] and EARLIER not in context


# --- the README ----------------------------------------------------------------------------------------


def readme_code() -> list[str]:
    return [b for b, is_code, _ in blocks(README.read_text()) if is_code]


def test_the_readme_is_short_and_starts_with_the_two_fresh_machine_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    main = "python3 -m pip install torch==2.13.0 && python3 -m pip install -e . && gqakit demo"
    tests = 'python3 -m pip install torch==2.13.0 && python3 -m pip install -e ".[dev]" && python3 -m pytest'
    assert text.index(main) < text.index(tests) < text.index("## ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests.replace("pip install", "pip install -q") in ci, ".ci/run runs the README's test command"


def test_every_command_has_a_readme_example():
    cmds = [words(c) for block in readme_code() for c in command_lines(block, True)]
    verbs = {argv[1] for argv in cmds if argv[0] == "gqakit"}
    assert verbs >= set(COMMANDS), set(COMMANDS) - verbs
    presets = {w for block in readme_code() for w in re.findall(r"--preset (\w+)", block)}
    assert {"fast", "best"} <= presets


MODEL_ARGS = {"inspect": 1, "convert": 1, "expand": 1, "export": 1, "eval": 1, "probe": 1, "recovery": 1}
MADE_BY = {"convert": 2, "expand": 2, "export": 2}  # the positional argument each one writes


def test_every_readme_example_runs_as_written_on_a_fresh_machine():
    """Each model an example reads is an asset or made by an example before it; each ``$VAR`` is set
    before it is used; each file in the repository it names exists."""
    from gqakit import assets

    known = set(assets.ASSETS) | set(getattr(assets, "BUILT", {}))
    made: set[str] = set()
    defined = {"GQAKIT_CACHE", "HOME"}
    problems = []
    for block in readme_code():
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            for var in re.findall(r"\$\{?([A-Za-z_]\w*)", line):
                if var not in defined:
                    problems.append(f"${var} is not defined before: {line}")
            assignment = re.match(r"^([A-Za-z_]\w*)=", line)
            if assignment:
                defined.add(assignment.group(1))
                continue
            for cmd in command_lines(line, True):
                argv = words(cmd)
                if argv[0] != "gqakit":
                    continue
                positional = [w for w in argv[2:] if not w.startswith("-")]
                verb = argv[1]
                values = dict(zip(argv, argv[1:], strict=False))
                sources = positional[: MODEL_ARGS.get(verb, 0)] + [values.get("--baseline")]
                for src in filter(None, sources):
                    if src not in known | made:
                        problems.append(f"{src} is neither an asset nor made before: {cmd}")
                if verb in MADE_BY and len(positional) >= MADE_BY[verb]:
                    made.add(positional[MADE_BY[verb] - 1])
                for w in argv:
                    if re.match(r"^[\w.-]+/[\w./-]+\.(ya?ml|txt|py)$", w) and not (ROOT / w).exists():
                        problems.append(f"{w} does not exist: {cmd}")
    assert not problems, problems


def test_the_readme_names_the_text_folder_that_assets_fetch_prints(tmp_path, monkeypatch):
    """``W=...`` in the README is the wiki-en folder ``gqakit assets fetch`` prints, with and without
    ``$GQAKIT_CACHE``, and each ``$W/NAME`` is a file of that asset."""
    from gqakit.asset_builders import SPLITS
    from gqakit.storage import cache_root

    text = "\n".join(readme_code())
    [line] = [x.split("#")[0].strip() for x in text.splitlines() if x.startswith("W=")]
    for env in ({"GQAKIT_CACHE": str(tmp_path)}, {}):
        monkeypatch.delenv("GQAKIT_CACHE", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        shell = subprocess.run(["bash", "-c", f'{line}; printf %s "$W"'], capture_output=True, text=True)
        assert Path(shell.stdout) == cache_root() / "wiki-en", env
    assert set(re.findall(r"\$W/(\w+)\.txt", text)) <= set(SPLITS)


def cells(row: str) -> list[str]:
    return [c.strip().replace("**", "") for c in row.strip().strip("|").split("|")]


def table_after(text: str, marker: str) -> list[list[str]]:
    """The body rows of the first markdown table after ``marker``."""
    lines = text[text.index(marker) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return rows


def shown(value: float, cell: str) -> bool:
    """Whether ``cell`` (e.g. ``17,655``, ``1.78x``, ``68.3 ±3%``) shows ``value`` to its own digits."""
    number = re.match(r"[\d,]+(?:\.(\d+))?", cell)
    if number is None:
        return False
    digits = len(number.group(1) or "")
    return abs(float(number.group(0).replace(",", "")) - value) <= 0.5 * 10**-digits + 1e-9


def test_the_readme_table_is_the_demos_result_file():
    results = json.loads((RESULTS / "demo" / "results.json").read_text())
    by_label = {r["label"]: r for r in results["rows"]}
    rows = table_after(README.read_text(), "## The demo's results")
    assert [r[0] for r in rows] == [r["label"] for r in results["rows"]]
    first = results["rows"][0]
    for label, heads, ppl, kv, tps, speedup, cpp, cpp_speedup in rows:
        r = by_label[label]
        assert int(heads) == r["kv_heads"], label
        assert shown(r["ppl"], ppl) and shown(r["kv_mib_2048"], kv), label
        assert shown(r["decode_tokens_per_s"], tps) and shown(r["llamacpp_tokens_per_s"], cpp), label
        assert shown(r["decode_tokens_per_s"] / first["decode_tokens_per_s"], speedup), label
        assert shown(r["llamacpp_tokens_per_s"] / first["llamacpp_tokens_per_s"], cpp_speedup), label


# --- docs/recovery.md's summary ------------------------------------------------------------------------

# Each summary row (its start and rate cells) -> the run and start whose results.json it shows.
CPU, GPU = RESULTS / "recovery", RESULTS / "gpu-h100"
RECOVERY_CPU = {
    ("`mean`", "2e-4"): (CPU / "smollm2-mqa", "mean"),
    ("calibrated, no refinement", "2e-4"): (CPU / "smollm2-mqa", "calibrated"),
    ("`fast` (4,096 x 200)", "2e-4"): (CPU / "smollm2-mqa", "refined"),
    ("`fast`, seed 1", "2e-4"): (CPU / "smollm2-mqa-seed1", "refined"),
    ("32,768 x 800", "2e-4"): (CPU / "smollm2-mqa-32k", "refined"),
    ("32,768 x 800", "5e-5"): (CPU / "smollm2-mqa-32k-lr5e-5", "refined"),
    ("49,152 x 1,600", "5e-5"): (CPU / "smollm2-mqa-48k-lr5e-5", "refined"),
    ("49,152 x 1,600, run to 409,600", "5e-5"): (CPU / "smollm2-mqa-48k-lr5e-5-410k", "refined"),
    ("`best` (49,152 x 1,600, `layer-corrective`)", "5e-5"): (CPU / "smollm2-mqa-48k-lcpt-lr5e-5", "refined"),
}
RECOVERY_GPU = {
    ("`mean`", "2e-4"): (GPU / "smollm2-mqa-5m", "mean"),
    ("`mean`", "1e-3 (its best of 3)"): (GPU / "smollm2-mqa-5m-lr-sweep-a", "mean"),
    ("calibrated, no refinement", "2e-4"): (GPU / "smollm2-mqa-5m", "calibrated"),
    ("`best`", "2e-4"): (GPU / "smollm2-mqa-5m", "refined"),
    ("`best`", "4e-4"): (GPU / "smollm2-mqa-5m-lr-sweep-b", "refined"),
    ("`best`, seed 1", "2e-4"): (GPU / "smollm2-mqa-5m-seed1", "refined"),
}


@pytest.mark.parametrize("marker,runs", [("On 2 CPU cores", RECOVERY_CPU), ("On one H100", RECOVERY_GPU)])
def test_the_recovery_summary_is_the_recovery_result_files(marker, runs):
    text = (ROOT / "docs" / "recovery.md").read_text()
    rows = table_after(text[text.index("## Summary") :], marker)
    assert [(r[0], r[1]) for r in rows] == list(runs)
    for row in rows:
        run, start = runs[(row[0], row[1])]
        result = json.loads((run / "results.json").read_text())["starts"][start]
        assert float(row[1].split()[0]) == pytest.approx(result["lr"]), row
        assert shown(result["points"][0]["ratio"], row[2]), row
        for threshold, cell in zip(["1.5", "1.2", "1.1", "1.05"], row[3:7], strict=True):
            assert cell == result["reach"][threshold]["label"], (row, threshold)
        assert shown(result["points"][-1]["ratio"], row[7]), row


# --- benchmarks/, links, hashes, paths -------------------------------------------------------------------


def test_benchmarks_hold_only_the_scripts_the_docs_name():
    """A script stays while a doc names it (or a named script imports it); one-off studies go, and their
    figures stay in the docs with the version that measured them."""
    scripts = sorted(p for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))
    named = "\n".join(p.read_text() for p in [README, *DOCS, Path(__file__)])
    code = "\n".join(p.read_text() for p in scripts)
    orphans = [
        p.name
        for p in scripts
        if f"benchmarks/{p.name}" not in named and not re.search(rf"^(from|import) {p.stem}\b", code, re.M)
    ]
    assert not orphans, f"scripts that no doc names: {orphans}"
    assert sum(len(p.read_text().splitlines()) for p in BENCH.rglob("*.py")) <= 2000


def gqakit_imports(source: str) -> list[ast.ImportFrom]:
    """The ``from gqakit... import`` statements of a script, and of the code it runs from strings."""
    trees = [ast.parse(source)]
    trees += [
        ast.parse(node.value)
        for node in ast.walk(trees[0])
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "from gqakit" in node.value
    ]
    return [
        node
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gqakit")
    ]


def test_the_benchmark_scripts_import_what_gqakit_has():
    missing = []
    for script in sorted(BENCH.glob("*.py")):
        for node in gqakit_imports(script.read_text()):
            module = importlib.import_module(node.module)
            missing += [
                f"{script.name}: from {node.module} import {a.name}"
                for a in node.names
                if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None
            ]
    assert not missing, missing


def test_every_relative_link_resolves():
    broken = []
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    heads = re.findall(r"^#+\s+(.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


# A git commit id as people paste it: 7 to 40 hex digits, with letters and digits both (not a number, not
# a word like "defaced"); a 64-digit sha256 of a file is not one.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_the_docs_hold_no_commit_hashes():
    found = {str(p.relative_to(ROOT)): COMMIT.findall(p.read_text()) for p in [*DOCS, README]}
    assert COMMIT.findall("at commit 70eb8e3, sha256 " + "ab12" * 16) == ["70eb8e3"]
    assert not {k: v for k, v in found.items() if v}, found


def test_no_result_file_holds_an_absolute_path():
    found = {
        str(p.relative_to(ROOT)): relative_paths.absolute_paths(p.read_text())
        for p in relative_paths.result_files(RESULTS)
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


@pytest.mark.parametrize(
    "cell,value,ok",
    [("17,655", 17655.4, True), ("1.78x", 1.7836, True), ("1.78x", 1.7749, False), ("68.3 ±3%", 68.32, True)],
)
def test_shown_reads_a_cell_to_its_own_digits(cell, value, ok):
    assert shown(value, cell) is ok
