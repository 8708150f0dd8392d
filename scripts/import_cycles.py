"""Import circles between the package's modules, read from the source.

    python scripts/import_cycles.py [--path opentinker] [--load-time]

An edge A -> B is an import in A of module B, or of a name B defines (``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``), anywhere in A except under
``if TYPE_CHECKING:``: an import deferred into a function still ties the two modules together
(the design's rule: no circle outside type-only imports). ``--load-time`` counts only what runs
when A loads (its top level). A circle is a strongly connected group of two or more modules.
Prints each circle (one edge path through it) and exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under the package folder ``root``."""
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt], deferred: bool):
    """Import statements in ``body`` and the blocks under it, but not under ``if TYPE_CHECKING:``;
    those inside functions and classes only when ``deferred``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse, deferred)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not deferred:
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    yield from _imports([n for n in block if isinstance(n, ast.AST)], deferred)


def import_graph(root: Path, deferred: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``deferred``: inside functions too)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body, deferred):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a deep chain of imports cannot reach Python's recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def path_through(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """One circle through the group's first module, by breadth-first search inside the group."""
    start, members = group[0], set(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    trail = [node]
                    while trail[-1] != start:
                        trail.append(previous[trail[-1]])
                    return [start, *reversed(trail[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return group


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=str(Path(__file__).resolve().parents[1] / "opentinker"))
    parser.add_argument("--load-time", action="store_true", help="only the imports run when a module loads")
    args = parser.parse_args()
    graph = import_graph(Path(args.path), deferred=not args.load_time)
    found = circles(graph)
    edges = sum(len(targets) for targets in graph.values())
    kind = "load-time" if args.load_time else "non-type-only"
    print(f"{len(graph)} modules, {edges} {kind} imports between them, {len(found)} circle(s)")
    for group in found:
        print(f"  {len(group)} modules: " + " -> ".join(path_through(graph, group)))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
