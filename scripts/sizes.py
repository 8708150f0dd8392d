"""Where size is going: the largest modules, classes and functions of the package, in lines.

    python scripts/sizes.py [--top 15] [--path opentinker] [--max-module 500] [--max-class 250]
                            [--max-function 60]

Lines are counted from a definition's first line (decorators included) to its last, blank lines
and comments inside it included: what a reader has to scroll through. A method counts as a
function of its own too. The limits (the design's goals: no module over 500 lines, no class over
250, no function over 60) only mark rows with ``!`` and count them; the script never fails, it
shows.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sized:
    kind: str  # module | class | function
    name: str  # module path, or module:Qualified.name
    lines: int


def _span(node: ast.AST) -> int:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
    return node.end_lineno - first + 1


def sizes(root: Path) -> list[Sized]:
    found: list[Sized] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        module = str(path.relative_to(root.parent))
        found.append(Sized("module", module, len(text.splitlines())))

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    name = f"{prefix}{child.name}"
                    found.append(Sized("class", f"{module}:{name}", _span(child)))
                    visit(child, name + ".")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    found.append(Sized("function", f"{module}:{name}", _span(child)))
                    visit(child, name + ".<locals>.")

        visit(ast.parse(text, filename=str(path)), "")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=str(Path(__file__).resolve().parents[1] / "opentinker"))
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--max-module", type=int, default=500)
    parser.add_argument("--max-class", type=int, default=250)
    parser.add_argument("--max-function", type=int, default=60)
    args = parser.parse_args()
    found = sizes(Path(args.path))
    limits = {"module": args.max_module, "class": args.max_class, "function": args.max_function}
    for kind in ("module", "class", "function"):
        rows = sorted((s for s in found if s.kind == kind), key=lambda s: -s.lines)
        over = sum(1 for s in rows if kind in limits and s.lines > limits[kind])
        limit = f", {over} over {limits[kind]} lines" if kind in limits else ""
        total = f", {sum(s.lines for s in rows)} lines" if kind == "module" else ""
        print(f"{'classes' if kind == 'class' else kind + 's'}: {len(rows)}{total}{limit}")
        for s in rows[: args.top]:
            mark = "!" if kind in limits and s.lines > limits[kind] else " "
            print(f"  {mark} {s.lines:5d}  {s.name}")


if __name__ == "__main__":
    main()
