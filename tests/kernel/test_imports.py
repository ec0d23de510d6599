"""No import cycle among the kernel's modules, counting every import statement: module level,
inside functions and under ``TYPE_CHECKING`` (a cycle hidden in a function is still two modules
that cannot be understood, tested or moved one without the other)."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

FRAMEWORK = Path(__file__).resolve().parents[2] / "framework"
KERNEL = "modelrunner"


def kernel_modules(root: Path = FRAMEWORK, top: str = KERNEL) -> dict[str, Path]:
    """Dotted name → file of every module of the package ``top`` under ``root`` (a package is its ``__init__``)."""
    modules = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The kernel modules ``name`` imports anywhere in its file → the line of the first such import.

    ``from package import submodule`` counts as importing the submodule, ``from package import Name``
    as importing the package; ``import a.b.c`` as importing ``a.b.c``.
    """

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != KERNEL:
                continue
            module = module_of(target)
            if module is not None and module != name:
                found.setdefault(module, node.lineno)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module → {imported kernel module: line}."""
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component of ``graph`` that has one (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    found = []
    for component in components:
        first = min(component)
        parent = {first: first}
        queue = deque([first])
        while queue:  # breadth first from ``first``, inside the component, to a module importing it
            node = queue.popleft()
            if first in graph[node]:
                path = [node]
                while path[-1] != first:
                    path.append(parent[path[-1]])
                found.append([*reversed(path), first])
                break
            for nxt in sorted(graph[node]):
                if nxt in component and nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
    return found


def describe(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path],
             root: Path = FRAMEWORK) -> str:
    """``a (a.py:12) → b (b.py:40) → a``: each module with the line of its import of the next."""
    steps = []
    for here, nxt in zip(cycle, cycle[1:]):
        where = modules[here].relative_to(root).as_posix()
        steps.append(f"{here} ({where}:{graph[here][nxt]})")
    return " → ".join([*steps, cycle[-1]])


def test_the_kernels_modules_import_each_other_without_a_cycle():
    modules = kernel_modules()
    graph = import_graph(modules)
    found = [describe(c, graph, modules) for c in cycles(graph)]
    assert not found, "import cycles among the kernel's modules (move the code to where it belongs; see " \
                      "docs/architecture.md#import-rules):\n  " + "\n  ".join(found)


def test_the_walk_sees_imports_in_functions_and_under_type_checking(tmp_path):
    package = tmp_path / KERNEL / "sub"
    package.mkdir(parents=True)
    (tmp_path / KERNEL / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n")
    (package / "b.py").write_text("def f():\n    from ..sub.c import C\n")
    (package / "c.py").write_text("import modelrunner.sub.a\nfrom . import b\n")
    modules = kernel_modules(tmp_path)
    graph = import_graph(modules)
    assert graph[f"{KERNEL}.sub"] == {f"{KERNEL}.sub.a": 1}
    assert graph[f"{KERNEL}.sub.c"] == {f"{KERNEL}.sub.a": 1, f"{KERNEL}.sub.b": 2}
    found = cycles(graph)
    assert len(found) == 1 and found[0][0] == found[0][-1] and set(found[0]) == {f"{KERNEL}.sub.{m}" for m in "abc"}
    assert "modelrunner.sub.a (modelrunner/sub/a.py:3) → modelrunner.sub.b (modelrunner/sub/b.py:2) → " \
           "modelrunner.sub.c (modelrunner/sub/c.py:1) → modelrunner.sub.a" == describe(found[0], graph, modules, tmp_path)
