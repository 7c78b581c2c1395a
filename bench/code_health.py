"""Code-health figures of the library (issue 55's targets): function length and file size.

A function's length is its lines from `def` to the end of its body (docstring and comments
included), as `ast` gives them. Prints the count, median, p90 (statistics.quantiles, n=10) and max
of every function in the library packages, the longest functions, and the files over the size
limit. Figures, not a pass/fail: docs/code-health.md says what each target is.

    .venv/bin/python bench/code_health.py [--longest 15] [--max-file-lines 500]
"""

from __future__ import annotations

import argparse
import ast
import statistics
from dataclasses import dataclass
from pathlib import Path

LIBRARY = (
    "settings",
    "scheduler",
    "router",
    "frontend",
    "engine",
    "workers",
    "cluster",
    "deploy",
    "sim",
)
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Function:
    lines: int
    where: str  # path:line name


def functions(root: Path = ROOT) -> list[Function]:
    """Every function and method of the library, by length."""
    found = []
    for package in LIBRARY:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    where = f"{path.relative_to(root)}:{node.lineno} {node.name}"
                    found.append(Function(length, where))
    return sorted(found, key=lambda f: f.lines)


def long_files(limit: int, root: Path = ROOT) -> list[tuple[int, str]]:
    """Library files over `limit` lines, longest first."""
    sizes = [
        (len(path.read_text().splitlines()), str(path.relative_to(root)))
        for package in LIBRARY
        for path in (root / package).rglob("*.py")
    ]
    return sorted((s for s in sizes if s[0] > limit), reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--longest", type=int, default=15, help="longest functions listed")
    parser.add_argument("--max-file-lines", type=int, default=500)
    a = parser.parse_args()
    found = functions()
    lengths = [f.lines for f in found]
    p90 = statistics.quantiles(lengths, n=10)[8]
    print(
        f"functions {len(found)}: median {statistics.median(lengths):g}, p90 {p90:g}, "
        f"max {lengths[-1]}; over 20 lines: {sum(n > 20 for n in lengths)}"
    )
    for f in reversed(found[len(found) - a.longest :]):
        print(f"  {f.lines:4d} {f.where}")
    print(f"files over {a.max_file_lines} lines:")
    for lines, path in long_files(a.max_file_lines):
        print(f"  {lines:4d} {path}")


if __name__ == "__main__":
    main()
