"""The package layout the README's map describes: no import cycles between packages nor between
any two modules of the repository, the bottom layers import nothing above them, and the packages
split into modules by topic import one way."""

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
    "benchmarks": {"pipelines.core", "pipelines.errors", "pipelines.inputs"},
}
# What the import graphs cover: every package that ships.
SOURCES = ("pipelines", "benchmarks", "pyvision_cli")
# Packages split into one module per idea: their modules import one way (helpers never import
# the modules that use them, nor the package __init__ that re-exports them).
SPLIT = ("pipelines.agent.sandbox", "pipelines.report", "pipelines.rl")


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "pipelines" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0] if parts[0] in ("benchmarks", "pyvision_cli") else None


def import_graph() -> dict[str, set[str]]:
    """Package -> the packages it imports (module-level and inside functions alike)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in [p for source in SOURCES for p in ROOT.glob(f"{source}/**/*.py")]:
        src = _package(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                dst = _package(name)
                if dst and src and dst != src:
                    edges[src].add(dst)
    return edges


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``from pkg import name`` counts as ``pkg.name``
    when that is a module)."""
    paths = {}
    for path in [p for source in SOURCES for p in ROOT.glob(f"{source}/**/*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths
                         else node.module for a in node.names]
            else:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            edges[module].update(n for n in names if n in paths and n != module)
    return edges


def _reach(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Each group of nodes that import one another (directly or through others), sorted."""
    on_cycle = [a for a in edges if a in _reach(edges, a)]
    return sorted({tuple(sorted(b for b in on_cycle if b in _reach(edges, a) and a in
                                _reach(edges, b))) for a in on_cycle})


def test_no_package_imports_itself_back():
    edges = import_graph()
    cycles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a]
                     if a in _reach(edges, b)})
    assert not cycles, cycles
    assert {"pipelines.agent", "pipelines.rl", "pipelines.eval"} <= set(edges)  # the walk works


def test_no_module_imports_itself_back():
    """Module by module over the whole repository, imports inside functions included: a cycle that
    only a lazy import closes still means neither module can be read, tested or moved alone."""
    edges = module_graph()
    cycles = _cycles(edges)
    assert not cycles, cycles
    # The walk covers every package, and the lazy imports inside functions.
    assert "pipelines.models.pretrain" in edges["pyvision_cli.model"]
    assert "benchmarks.scoring" in edges["pipelines.scoring.reward"]


def test_the_bottom_layers_import_nothing_above_them():
    edges = import_graph()
    for package, allowed in FLOORS.items():
        assert edges.get(package, set()) <= allowed, (package, edges.get(package, set()) - allowed)


def test_the_modules_of_a_split_package_import_one_way():
    edges = module_graph()
    inside = {m: {n for n in deps if n.startswith(SPLIT)} for m, deps in edges.items()
              if m.startswith(SPLIT)}
    cycles = sorted({tuple(sorted((a, b))) for a in inside for b in inside[a]
                     if a in _reach(inside, b)})
    assert not cycles, cycles
    assert {"pipelines.rl.sampler", "pipelines.rl.logprobs"} <= set(edges["pipelines.rl.local"])
    assert "pipelines.agent.sandbox.isolation" in edges["pipelines.agent.sandbox.client"]
