"""The layering rule: shared code in gqakit/, the verbs above it, orchestration above the verbs.

::

    pipelines/   (gqakit.pipelines)   demo, probe, replicate: may import everything below
    convert/  eval/  uptrain/         the verbs: import gqakit/ (and uptrain may import convert,
                                      since a recipe can convert its model first), never each other
    gqakit/                           shared: text, checkpoints, models, GGUF; imports no verb

gqakit/cli.py names every command's module as a string and imports it lazily, so it is the one
module of gqakit/ that reaches upwards; it holds no import statement of a verb.

No import cycle either: the modules of the project, joined by every import they make (in functions and
under ``TYPE_CHECKING`` too), form no loop, so each module can be read (and imported) after the ones it
needs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package it installs as
LAYERS = {
    "gqakit": "gqakit",
    "convert": "gqakit.convert",
    "eval": "gqakit.eval",
    "uptrain": "gqakit.uptrain",
    "pipelines": "gqakit.pipelines",
}
UPPER = ("gqakit.convert", "gqakit.eval", "gqakit.uptrain", "gqakit.pipelines")
# package -> the upper packages it may import
ALLOWED = {
    "gqakit": (),
    "gqakit.convert": (),
    "gqakit.eval": (),
    "gqakit.uptrain": ("gqakit.convert",),
    "gqakit.pipelines": UPPER,
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute module name an ``import`` or ``from ... import`` in ``path`` names, with its line;
    imports inside functions count (a lazy import is still a dependency)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module == "gqakit":  # `from gqakit import convert` imports the subpackage
                found += [(node.lineno, f"gqakit.{alias.name}") for alias in node.names]
    return found


def _owner(module: str) -> str | None:
    for upper in UPPER:
        if module == upper or module.startswith(upper + "."):
            return upper
    return None


def violations(root: Path = ROOT) -> list[str]:
    """``file:line imports X`` for every import that breaks the layering rule."""
    bad = []
    for folder, package in LAYERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            for line, module in imported_modules(path):
                owner = _owner(module)
                if owner is None or owner == package or owner in ALLOWED[package]:
                    continue
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the project, by the name it imports as."""
    names = {}
    for folder, package in LAYERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names[".".join([package, *parts])] = path
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from pkg import submodule`` names the submodule)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for _, module in imported_modules(path):
            found.add(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """The groups of modules that import each other in a loop (Tarjan's strongly connected components)."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    cycles = import_cycles()
    assert not cycles, (
        "These modules import each other in a loop (function-level and TYPE_CHECKING imports count). Move "
        "what both need into a module of its own:\n" + "\n".join(" <-> ".join(c) for c in cycles)
    )


def test_a_cycle_through_a_function_level_import_is_caught(tmp_path: Path) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / "gqakit" / "a.py").write_text("from gqakit.b import x\n")
    (tmp_path / "gqakit" / "b.py").write_text("def x():\n    from gqakit import c\n")
    (tmp_path / "gqakit" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gqakit.a\n"
    )
    (tmp_path / "gqakit" / "d.py").write_text("import gqakit.a\n")
    assert import_cycles(tmp_path) == [["gqakit.a", "gqakit.b", "gqakit.c"]]


def undeclared_deferred_imports(root: Path = ROOT) -> list[str]:
    """``file:line`` of every import inside a function that no ``# deferred: why`` comment explains (on
    its line, or just above its run of imports). An import belongs at the top of its module unless it
    keeps a heavy or optional dependency out of the module's import."""
    bad = []
    for path in module_names(root).values():
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                above = node.lineno - 2
                while above >= 0 and (
                    not lines[above].strip() or lines[above].strip().startswith(("from ", "import ", ")"))
                ):
                    above -= 1
                comment = lines[above].strip() if above >= 0 else ""
                if "# deferred:" not in lines[node.lineno - 1] and not comment.startswith("# deferred:"):
                    bad.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(set(bad))


def test_imports_inside_functions_say_why() -> None:
    bad = undeclared_deferred_imports()
    assert not bad, (
        "Move these imports to the top of their module, or say above them what importing them costs "
        "(# deferred: ...):\n" + "\n".join(bad)
    )


def test_no_layer_imports_upwards_or_sideways() -> None:
    bad = violations()
    assert not bad, (
        "A verb imports a sibling verb or the orchestration layer, or gqakit/ imports a verb. Move what "
        "both need down into gqakit/, or the orchestration up into pipelines/:\n" + "\n".join(bad)
    )


@pytest.mark.parametrize(
    ("folder", "source", "expected"),
    [
        ("convert", "from gqakit.eval.data import load_texts\n", "imports gqakit.eval.data"),
        ("eval", "def f():\n    import gqakit.uptrain.loop\n", "imports gqakit.uptrain.loop"),
        ("gqakit", "from gqakit import pipelines\n", "imports gqakit.pipelines"),
        ("uptrain", "from gqakit.pipelines.store import ResultStore\n", "imports gqakit.pipelines.store"),
    ],
)
def test_the_rule_catches_each_kind_of_breach(
    tmp_path: Path, folder: str, source: str, expected: str
) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / folder / "bad.py").write_text(source)
    (tmp_path / "uptrain" / "ok.py").write_text("from gqakit.convert import ConvertOptions\n")
    (tmp_path / "pipelines" / "ok.py").write_text("import gqakit.eval\nimport gqakit.uptrain\n")
    (tmp_path / "gqakit" / "ok.py").write_text("from gqakit.errors import GqakitError\n")
    bad = violations(tmp_path)
    assert len(bad) == 1 and bad[0].startswith(f"{folder}/bad.py") and bad[0].endswith(expected), bad


def test_an_unexplained_import_inside_a_function_is_caught(tmp_path: Path) -> None:
    for name in LAYERS:
        (tmp_path / name).mkdir()
    (tmp_path / "gqakit" / "a.py").write_text(
        "def f():\n    import json\n\n\ndef g():\n    # deferred: transformers takes seconds\n"
        "    import transformers\n\n    from gqakit import b\n"
    )
    assert undeclared_deferred_imports(tmp_path) == ["gqakit/a.py:2"]
