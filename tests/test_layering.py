"""The package's layers: no import circle anywhere in ``pdserve/``, and the kernels at the bottom.

A circle makes a module's meaning depend on import order and keeps a piece from being read, tested
or moved alone; the kernels are the layer every other one builds on, so they import nothing of
the engine, the router or the benchmarks. Every import counts: top-level, inside a function, or
under ``TYPE_CHECKING`` (a lazy import is still a dependency). The graph is read from the AST of
every module; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO_ROOT

GENERATED = "pdserve.v1"  # grpcio-tools' stubs import each other by design


def module_files(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every module of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports, anywhere in its file. ``from a import b``
    counts as ``a.b`` when that is a module, else as ``a``; relative imports are resolved."""
    is_package = path.name == "__init__.py"
    named: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            named += [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
    found = set()
    for name in named:
        while name and name not in modules:  # a name inside a module: the module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {
        module: imports_of(module, path, modules)
        for module, path in modules.items()
        if not module.startswith(GENERATED)
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_pdserve():
    graph = import_graph(REPO_ROOT, "pdserve")
    assert len(graph) > 100, "the graph found suspiciously few modules"
    assert circles(graph) == []


def test_the_kernels_import_nothing_above_them():
    graph = import_graph(REPO_ROOT, "pdserve")
    upward = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith("pdserve.kernels")
        for target in targets
        if not target.startswith("pdserve.kernels")
    )
    assert upward == []


def test_the_checker_finds_a_circle_through_a_lazy_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n"
    )
    (package / "sub" / "c.py").write_text("def f():\n    from .. import a\n    return a\nX = 1\n")
    (package / "d.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.d"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
