"""The package layout the README's map describes: no import cycles between packages, and the
bottom layers import nothing above them."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What each bottom layer may import (besides itself).
FLOORS = {
    "pipelines.errors": set(),
    "pipelines.fsutil": {"pipelines.errors"},
    "pipelines.core": {"pipelines.errors", "pipelines.fsutil"},
    "pipelines.config": {"pipelines.errors", "pipelines.inputs"},
    "pipelines.store": {"pipelines.core", "pipelines.console", "pipelines.errors",
                        "pipelines.inputs"},
    "benchmarks": {"pipelines.core", "pipelines.errors"},
}


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "pipelines" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0] if parts[0] in ("benchmarks", "pyvision_cli") else None


def import_graph() -> dict[str, set[str]]:
    """Package -> the packages it imports (module-level and inside functions alike)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in [*ROOT.glob("pipelines/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]:
        src = _package(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                dst = _package(name)
                if dst and src and dst != src:
                    edges[src].add(dst)
    return edges


def test_no_package_imports_itself_back():
    edges = import_graph()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in reach(b)})
    assert not cycles, cycles
    assert {"pipelines.agent", "pipelines.rl", "pipelines.eval"} <= set(edges)  # the walk works


def test_the_bottom_layers_import_nothing_above_them():
    edges = import_graph()
    for package, allowed in FLOORS.items():
        assert edges.get(package, set()) <= allowed, (package, edges.get(package, set()) - allowed)
