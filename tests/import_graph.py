"""The import graph of grpo's own modules, read from the source with ``ast``.

Nothing is imported: each file under ``grpo_core/``, ``plugins/`` (the
``grpo_plugins`` package) and ``grpo/`` is parsed, and every import in it
becomes an :class:`Edge` tagged with where it runs:

* ``module``: at import time (module body, class bodies, ``try``/``if`` at the
  top level): these are the imports that can form a circle.
* ``function``: inside a function body, run only when it is called (a lazy
  import: for a heavy optional library, or, the smell issue #24 names, to hide
  a circle).
* ``type_checking``: under ``if TYPE_CHECKING:``, never run.

``importlib.import_module("x")`` / ``__import__("x")`` (and a
``find_spec("x")`` probe) with a literal name count as imports too. Run as a script it prints the circles and the lazy
imports between grpo's own modules: ``python tests/import_graph.py``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parent.parent

# Source folder -> the package name it imports as (pyproject's package-dir).
PACKAGES: dict[str, str] = {"grpo_core": "grpo_core", "plugins": "grpo_plugins", "grpo": "grpo"}

Level = Literal["module", "function", "type_checking"]
DYNAMIC_IMPORTERS = {"import_module", "__import__", "find_spec"}  # find_spec: a probe for an optional library


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (a dotted name, grpo's or a library's) at ``line``."""

    source: str
    target: str
    level: Level
    line: int


def module_name(path: Path, root: Path = REPO) -> str:
    """The dotted name ``path`` imports as (``plugins/vllm/pool.py`` -> ``grpo_plugins.vllm.pool``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(root: Path = REPO) -> dict[str, Path]:
    """Every module of grpo's packages, by dotted name."""
    return {module_name(path, root): path for folder in PACKAGES for path in sorted((root / folder).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """Resolve ``from ..x import y``'s module against the importing module's name."""
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


class _Collector(ast.NodeVisitor):
    """Walks one module, remembering whether it is inside a function or a TYPE_CHECKING block."""

    def __init__(self, importer: str, is_package: bool, known: set[str]) -> None:
        self.importer, self.is_package, self.known = importer, is_package, known
        self.level: Level = "module"
        self.edges: list[Edge] = []

    def _add(self, target: str, line: int) -> None:
        if target:
            self.edges.append(Edge(self.importer, target, self.level, line))

    def _inside(self, level: Level, nodes: list[ast.stmt] | list[ast.AST]) -> None:
        outer, self.level = self.level, level if self.level != "type_checking" else self.level
        for node in nodes:
            self.visit(node)
        self.level = outer

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for decorator in node.decorator_list:  # run at definition time, like the default values
            self.visit(decorator)
        self._inside("function", node.body)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._inside("function", [node.body])

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._inside("type_checking", node.body)
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _absolute(node.module, node.level, self.importer, self.is_package)
        targets = []
        for alias in node.names:
            submodule = f"{module}.{alias.name}" if module else alias.name
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod.
            target = submodule if submodule in self.known else module
            if target not in targets:
                targets.append(target)
        for target in targets:
            self._add(target, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name in DYNAMIC_IMPORTERS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self._add(first.value, node.lineno)
        self.generic_visit(node)


def module_edges(source: str, importer: str, is_package: bool = False, known: set[str] | None = None) -> list[Edge]:
    """Every import in one module's source, each with where it runs."""
    collector = _Collector(importer, is_package, known or set())
    collector.visit(ast.parse(source))
    return collector.edges


def all_edges(root: Path = REPO) -> list[Edge]:
    """Every import in grpo's packages."""
    files = source_files(root)
    known = set(files)
    return [
        edge
        for name, path in files.items()
        for edge in module_edges(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", known)
    ]


def unexplained_lazy_imports(source: str) -> list[int]:
    """Lines of the import blocks inside function bodies with no comment
    saying why they are there: a block (consecutive import statements) is
    explained by a comment on the line above it or on one of its lines.
    Top-level code (module, class bodies, ``if TYPE_CHECKING``) is not asked."""
    lines = source.splitlines()
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        bodies = [func.body] + [
            getattr(node, field)
            for node in ast.walk(func)
            if node is not func
            for field in ("body", "orelse", "finalbody")
            if isinstance(getattr(node, field, None), list)
        ]
        for body in bodies:
            block: list[ast.stmt] = []
            for stmt in [*body, None]:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    block.append(stmt)
                    continue
                if block:
                    above = lines[block[0].lineno - 2].strip() if block[0].lineno > 1 else ""
                    commented = any("#" in lines[i] for s in block for i in range(s.lineno - 1, s.end_lineno))
                    if not (above.startswith("#") or commented):
                        found.append(block[0].lineno)
                block = []
    return sorted(set(found))


def own(target: str, known: set[str]) -> str | None:
    """The grpo module an import's target names, or None for a library (``grpo_core.x.Name`` -> ``grpo_core.x``)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def graph(edges: list[Edge], known: set[str], levels: set[str]) -> dict[str, set[str]]:
    """Module -> the grpo modules it imports, counting only imports run at ``levels``."""
    result: dict[str, set[str]] = {name: set() for name in known}
    for edge in edges:
        target = own(edge.target, known)
        if edge.level in levels and target is not None and target != edge.source:
            result[edge.source].add(target)
    return result


def cycles(adjacency: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; every circle lies in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the module count (about 150)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(adjacency.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(adjacency):
        if node not in index:
            visit(node)
    return sorted(found)


def edges_between(edges: list[Edge], members: set[str], known: set[str]) -> Iterator[Edge]:
    """The imports that tie a circle's members to each other."""
    for edge in edges:
        if edge.source in members and own(edge.target, known) in members - {edge.source}:
            yield edge


def _print_circles(title: str, found: list[list[str]], edges: list[Edge], known: set[str], levels: set[str]) -> None:
    print(f"{len(found)} circle(s) {title}")
    for members in found:
        print("circle:", " ".join(members))
        for edge in edges_between(edges, set(members), known):
            if edge.level in levels:
                print(f"    {edge.source}:{edge.line} -> {edge.target} ({edge.level})")


def main() -> int:
    """Print the circles: among module-level imports, once imports inside
    functions count, and once TYPE_CHECKING-only ones do. Exit 1 on a circle
    of imports that run."""
    known = set(source_files())
    edges = all_edges()
    print(f"{len(known)} modules, {len(edges)} imports")
    runtime: list[list[str]] = []
    for title, levels in (
        ("among module-level imports", {"module"}),
        ("once imports inside functions count too", {"module", "function"}),
        ("once TYPE_CHECKING-only imports count too (never run)", {"module", "function", "type_checking"}),
    ):
        found = cycles(graph(edges, known, levels))
        runtime = runtime or (found if "type_checking" not in levels else [])
        _print_circles(title, found, edges, known, levels)
    return 1 if runtime else 0


if __name__ == "__main__":
    sys.exit(main())
