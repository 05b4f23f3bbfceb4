"""Imports flow one way: models <- targets <- compile <- serving (DESIGN.md). A module may import from its own package
and the ones below it, never from one above, lazily inside a function included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("models", "targets", "compile", "serving")  # low to high


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def test_no_import_runs_upwards():
    back_edges = []
    for rank, package in enumerate(LAYERS):
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, name in _imports(path):
                parts = name.split(".")
                if parts[0] == "kiln" and len(parts) > 1 and parts[1] in LAYERS and LAYERS.index(parts[1]) > rank:
                    back_edges.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not back_edges, "imports against models <- targets <- compile <- serving:\n" + "\n".join(back_edges)


def test_every_package_says_what_it_may_import():
    for package in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text(encoding="utf-8")))
        assert doc and "import" in doc, f"{package}/__init__.py: say what lives there and what it may import"
