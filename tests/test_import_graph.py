"""The package's import graph: no circle among kvmosaic's modules, and the model never reaches up into
the worker. Every import counts (module level, inside functions, and under ``TYPE_CHECKING``): a
circle that only type checking closes still means two modules that each need the other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvmosaic"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The kvmosaic modules a module's source imports (``from a import b`` names a.b, not a, when b is a
    module)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            if len(submodules) < len(node.names):  # some name is the package's own, not a submodule
                found.add(base)
            found.update(submodules)
    return {m for m in found if m in known and m != name}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    mods = modules(root)
    known = set(mods)
    return {name: imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
            for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_walk_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "kvmosaic"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from kvmosaic.b import y\n")
    (pkg / "b.py").write_text("def f():\n    from kvmosaic.a import x\n    return x\ny = 1\n")
    (pkg / "c.py").write_text("from .a import x\nimport kvmosaic.b\nfrom kvmosaic.b import f\n")
    graph = import_graph(pkg)
    assert graph["kvmosaic.a.x"] == {"kvmosaic.b"}
    assert graph["kvmosaic.b"] == {"kvmosaic.a.x"}  # a submodule, not its package
    assert graph["kvmosaic.c"] == {"kvmosaic.a.x", "kvmosaic.b"}
    assert find_cycle(graph) == ["kvmosaic.a.x", "kvmosaic.b", "kvmosaic.a.x"]
    assert find_cycle({"p": {"q"}, "q": set()}) is None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# The layers read top-down: API -> engine -> scheduler / KV manager (core) -> executor / worker -> model
# -> attention -> kernels. A package here never imports one that sits above it.
ABOVE = {
    "kvmosaic.model": ["kvmosaic.worker", "kvmosaic.executor", "kvmosaic.engine", "kvmosaic.core",
                       "kvmosaic.distributed", "kvmosaic.disagg", "kvmosaic.entrypoints"],
    "kvmosaic.attention": ["kvmosaic.model", "kvmosaic.worker", "kvmosaic.executor", "kvmosaic.engine",
                           "kvmosaic.core", "kvmosaic.distributed", "kvmosaic.disagg", "kvmosaic.entrypoints"],
    "kvmosaic.core": ["kvmosaic.worker", "kvmosaic.executor", "kvmosaic.engine", "kvmosaic.model",
                      "kvmosaic.attention", "kvmosaic.distributed", "kvmosaic.disagg", "kvmosaic.entrypoints"],
}


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("lower", sorted(ABOVE))
def test_lower_layers_do_not_import_upper_ones(lower):
    reaching = sorted(f"{name} -> {target}" for name, targets in import_graph().items() if _inside(name, lower)
                      for target in targets if any(_inside(target, upper) for upper in ABOVE[lower]))
    assert not reaching, f"{lower} imports a layer above it: {reaching}"
