"""No import cycles inside localrun/ (issue 12, Deliver 7; issue 29: counting every import).

The graph is read from the source, not from a running interpreter: every
``import`` and ``from ... import`` in every localrun/**/*.py, at module level, inside
functions (an import inside a function is a cycle that waits for its first call) and
under ``if TYPE_CHECKING:`` alike (two modules that need each other's names, even for
annotations only, are one module's worth of design split in two). An edge goes to the
module named; ``from pkg import name`` goes to ``pkg.name`` when that is a module, else to
``pkg``. Dynamic imports (``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = "localrun"


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    file: str
    line: int


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement: module level, in functions, under ``if TYPE_CHECKING:``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def edges(root: Path = ROOT, package: str = PACKAGE) -> list[Edge]:
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(f, root): f for f in files}
    out: dict[Edge, None] = {}  # ordered, without repeats
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        rel = str(path.relative_to(root))
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                # "import localrun.x.y" names a module; keep the longest known prefix
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                edge = Edge(name, target, rel, node.lineno)
                if target and target != name:
                    out[edge] = None
    return list(out)


def cycles(graph_edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in graph_edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # recursion depth: the package's module count at most
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(component: list[str], graph_edges: list[Edge]) -> str:
    """One component: the imports that tie it together, as file:line -> module."""
    members = set(component)
    lines = [f"cycle among {', '.join(component)}:"]
    for e in sorted(graph_edges, key=lambda e: (e.file, e.line)):
        if e.source in members and e.target in members:
            lines.append(f"  {e.file}:{e.line} imports {e.target}")
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    graph_edges = edges()
    found = cycles(graph_edges)
    assert not found, "import cycles in localrun/:\n" + "\n".join(
        describe(c, graph_edges) for c in found)


def test_the_walker_sees_what_it_must(tmp_path: Path) -> None:
    """The checker itself: function-level and TYPE_CHECKING imports count (and an else
    branch's), relative imports resolve, and a cycle is found and named with its lines."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n"
        "else:\n    from .. import a\n")
    (pkg / "d.py").write_text("from pkg.sub.c import x\n")
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg import f\n")
    (pkg / "f.py").write_text("def g():\n    import pkg.e\n")
    got = edges(tmp_path, "pkg")
    assert {(e.source, e.target) for e in got} == {
        ("pkg.a", "pkg.b"), ("pkg.b", "pkg.sub.c"), ("pkg.sub.c", "pkg.a"),
        ("pkg.sub.c", "pkg.d"), ("pkg.d", "pkg.sub.c"), ("pkg.e", "pkg.f"),
        ("pkg.f", "pkg.e")}
    found = cycles(got)
    assert found == [["pkg.a", "pkg.b", "pkg.d", "pkg.sub.c"], ["pkg.e", "pkg.f"]]
    text = describe(found[0], got)
    assert "pkg/b.py:2 imports pkg.sub.c" in text and "pkg/sub/c.py:5 imports pkg.a" in text
    assert "pkg/sub/c.py:3 imports pkg.d" in text  # under TYPE_CHECKING: it counts
