"""The longest functions of the project's packages, by source lines (`def` to its last line).

Usage: python tools/longest_functions.py [-n 10] [PATH ...]   (default: every package but tests)
The house issue asks for this list before and after a restructuring; it is also a quick way to
find the next function worth splitting.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

DEFAULT_ROOTS = ("ir", "planner", "runtime", "tasks", "jobs", "confidant", "benchmarks")


def functions(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    stack = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield child.end_lineno - child.lineno + 1, f"{path}:{child.lineno}", name
                stack.append((child, name + "."))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, f"{prefix}{child.name}."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("-n", type=int, default=10, help="how many to list (default %(default)s)")
    args = parser.parse_args()
    roots = args.paths or [Path(r) for r in DEFAULT_ROOTS if Path(r).is_dir()]
    files = [f for r in roots for f in ([r] if r.is_file() else sorted(r.rglob("*.py")))]
    rows = sorted((row for f in files for row in functions(f)), reverse=True)[: args.n]
    for lines, where, name in rows:
        print(f"{lines:5d}  {name:45s} {where}")


if __name__ == "__main__":
    main()
