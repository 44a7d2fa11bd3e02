#!/usr/bin/env python3
"""The package's shape from its source (nothing is imported): modules, import depth, circles, imports that
point up a floor, and the longest functions.

    python tools/layout_report.py [--json]

Floors (bottom up) are the import directions docs/architecture.md describes; a module may import its own floor and
the floors below it. Exits 1 when there is a circle or an upward import.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lowmem_grpo"
# the first dotted part below lowmem_grpo (a module or a folder) -> its floor
FLOORS = {
    "errors": 1, "device": 1,
    "rewards": 2, "distributed": 2,
    "data": 3,
    "recipe": 4, "recipe_rules": 4, "runtime": 4, "presets": 4,
    "recipe_io": 5, "memory": 5, "combinations": 5, "backends": 5, "doctor": 5,
    "rundir": 6,
    "sampling": 7,
    "evaluation": 8, "export": 8,
    "train": 9,
    "cli": 10,
}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file, lazily or not)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    edges[name].add(target)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return found


def depth(edges: dict[str, set[str]]) -> int:
    """Levels of the longest import chain (1 = a module that imports nothing of the package)."""
    memo: dict[str, int] = {}

    def level(v: str, seen: frozenset[str]) -> int:
        if v not in memo:
            memo[v] = 1 + max((level(w, seen | {v}) for w in edges[v] if w not in seen), default=0)
        return memo[v]

    return max((level(v, frozenset()) for v in edges), default=0)


def floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits on a higher floor."""
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if floor(a) is not None and floor(b) is not None and floor(b) > floor(a))


def longest_functions(mods: dict[str, Path], count: int = 3) -> list[tuple[int, str]]:
    """The longest functions as (lines, 'file:line name'); the argument parser aside."""
    found = []
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "build_parser":
                rel = path.relative_to(PACKAGE.parent)
                found.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)[:count]


def report() -> dict:
    mods = modules()
    edges = imports(mods)
    top = [m for m in mods if m.count(".") == 1 and mods[m].name != "__init__.py"]
    return {"modules": len(mods), "top_level_modules": len(top), "import_depth": depth(edges),
            "circles": circles(edges), "upward_imports": upward(edges),
            "unplaced": sorted(m for m in mods if m != "lowmem_grpo" and floor(m) is None),
            "longest_functions": longest_functions(mods)}


def main() -> int:
    shape = report()
    if "--json" in sys.argv:
        print(json.dumps(shape, indent=2))
    else:
        print(f"{shape['modules']} modules ({shape['top_level_modules']} at the top), import depth "
              f"{shape['import_depth']} levels, {len(shape['circles'])} circles, "
              f"{len(shape['upward_imports'])} upward imports")
        for lines, where in shape["longest_functions"]:
            print(f"  {lines:4d} lines  {where}")
        for a, b in shape["upward_imports"]:
            print(f"  upward: {a} -> {b}")
        for group in shape["circles"]:
            print(f"  circle: {' <-> '.join(group)}")
    return 1 if shape["circles"] or shape["upward_imports"] or shape["unplaced"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
