"""The package's layers point one way: the import graph of ``pisa_compile`` has no cycle,
``kernels`` imports nothing from the layers above it, ``lowering`` never reaches a kernel,
and nothing in the package imports the experiments, the benchmarks or the tests.

The graph counts every import statement, also those inside functions (a lazy import is
still a dependency), and reads the sources with ``ast`` (nothing is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "pisa_compile"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules ``name`` imports: ``pisa_compile.*`` resolved to modules where they exist,
    other top-level packages by their first component."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in known else mod)
    return {m for m in out if m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(n, p, known) for n, p in mods.items()}


def _find_cycle(graph: dict[str, set[str]]):
    inside = {n: {m for m in deps if m in graph} for n, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(inside[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(inside):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("layer, allowed", [
    ("pisa_compile.kernels", ("pisa_compile.kernels",)),
    # the kernel names it validates against, and the one rule of where flat_leaves applies
    ("pisa_compile.config", ("pisa_compile.kernels.dispatch", "pisa_compile.kernels.geometry")),
    ("pisa_compile.lowering", ("pisa_compile.lowering", "pisa_compile.ops", "pisa_compile.config",
                               "pisa_compile.tables")),
])
def test_layers_import_only_below_them(layer, allowed):
    graph = _graph()
    bad = {(n, m) for n, deps in graph.items() if n == layer or n.startswith(layer + ".")
           for m in deps if m.startswith("pisa_compile") and not m.startswith(allowed)}
    # The package root re-exports; importing it from inside would be a hidden cycle.
    assert not bad, f"{layer} imports {sorted(bad)}"


def test_package_never_imports_experiments_benchmarks_or_tests():
    graph = _graph()
    bad = {(n, m) for n, deps in graph.items() for m in deps
           if m.split(".")[0] in ("experiments", "benchmarks", "tests")}
    assert not bad, sorted(bad)
