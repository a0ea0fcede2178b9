"""The layering rule: shared code in gqakit/, the verbs above it, orchestration above the verbs.

::

    pipelines/   (gqakit.pipelines)   demo, probe, replicate: may import everything below
    convert/  eval/  uptrain/         the verbs: import gqakit/ (and uptrain may import convert,
                                      since a recipe can convert its model first), never each other
    gqakit/                           shared: text, checkpoints, models, GGUF; imports no verb

gqakit/cli.py names every command's module as a string and imports it lazily, so it is the one
module of gqakit/ that reaches upwards; it holds no import statement of a verb.
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
