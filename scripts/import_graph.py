"""The project's structure as data: imports between its folders, import cycles between its
modules, and its longest functions.

    python scripts/import_graph.py [--largest 15] [--json OUT]

Reads every ``.py`` file of the project's packages with :mod:`ast` (nothing is imported or
run), counting every import statement, at module level or inside a function. A module's folder
is its package directory (``megatron/plugin``, ``megatron/plugin/layers``,
``megatron/plugin/pipeline``, ``elastic_pipe``, ...). Prints the folder graph (``A -> B: n``,
``n`` the importing modules), the module cycles (strongly connected components of more than
one module) and the ``--largest`` functions by lines. :data:`LAYERS` states which folder may
import which; ``tests/unit/test_import_graph.py`` holds the project to it.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("megatron/plugin", "elastic_pipe", "helix", "sppo_offload", "ir_1f1b", "longctx")
SCHEDULES = ("elastic_pipe", "helix", "sppo_offload", "ir_1f1b")

#: folder -> the project folders it may import (besides itself).
LAYERS = {
    "megatron/plugin/layers": set(),
    "megatron/plugin/pipeline": {"megatron/plugin/layers"},
    # The cost model and chunk rows are shared by the schedules; rows are packed with the
    # plugin's batches.
    "longctx": {"megatron/plugin", "megatron/plugin/layers", "megatron/plugin/pipeline"},
    "megatron/plugin": {"megatron/plugin/layers", "megatron/plugin/pipeline"},
    **{name: {"megatron/plugin", "megatron/plugin/layers", "megatron/plugin/pipeline",
              "longctx"} for name in SCHEDULES},
}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of :data:`PACKAGES`."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def folder_of(module: str, modules: dict[str, Path], root: Path = ROOT) -> str:
    """The package directory of ``module``, relative to the repository."""
    path = modules[module]
    return str(path.parent.relative_to(root))


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (``from package import module`` names the module,
    ``from module import name`` the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the other project modules it imports."""
    modules = module_files(root)
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def folder_edges(graph: dict[str, set[str]], root: Path = ROOT) -> dict[tuple[str, str], int]:
    """``(folder, imported folder) -> importing modules`` across folders."""
    modules = module_files(root)
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for module, targets in graph.items():
        source = folder_of(module, modules, root)
        for target in targets:
            folder = folder_of(target, modules, root)
            if folder != source:
                edges[source, folder].add(module)
    return {edge: len(importers) for edge, importers in sorted(edges.items())}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_violations(edges: dict[tuple[str, str], int]) -> list[str]:
    """Folder imports :data:`LAYERS` does not allow."""
    return [f"{source} -> {target}" for source, target in edges
            if source in LAYERS and target not in LAYERS[source]]


def largest_functions(count: int, root: Path = ROOT) -> list[tuple[int, str]]:
    """The ``count`` longest functions and methods: ``(lines, "path:line name")``."""
    sizes = []
    for path in module_files(root).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(root)}:{node.lineno} {node.name}"
                sizes.append((node.end_lineno - node.lineno + 1, where))
    return sorted(sizes, reverse=True)[:count]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--largest", type=int, default=15, help="longest functions to list")
    parser.add_argument("--json", help="write the report as JSON")
    args = parser.parse_args(argv)
    graph = import_graph()
    edges = folder_edges(graph)
    report = {"folder_edges": {f"{a} -> {b}": n for (a, b), n in edges.items()},
              "cycles": cycles(graph), "layer_violations": layer_violations(edges),
              "largest_functions": [{"lines": n, "function": where}
                                    for n, where in largest_functions(args.largest)]}
    print("folder imports (importing modules):")
    for edge, count in report["folder_edges"].items():
        print(f"  {edge}: {count}")
    print(f"module cycles: {report['cycles'] or 'none'}")
    print(f"imports the layering forbids: {report['layer_violations'] or 'none'}")
    print("longest functions:")
    for row in report["largest_functions"]:
        print(f"  {row['lines']:4d}  {row['function']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
