"""The package's layers, read from its source: no import loops, and no module imports a layer above
its own (docs/architecture.md draws the same diagram)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "blockspec"

# bottom to top; a module may import its own layer and those below it
LAYERS = [
    {"config", "errors", "sampling_params", "bad_words", "request", "reasoning", "structured", "inputs", "transfer",
     "assets"},
    {"kernels"},
    {"models", "sample"},
    {"drafters"},
    {"speculative"},
    {"engine"},
    {"parallel"},
    {"llm", "metrics_reader"},
    {"", "__main__", "cli", "cli_options", "demo", "server", "bench", "train"},
]


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (function-level imports too)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root.name:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == root.name)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Sets of modules that import each other, directly or through others (strongly connected)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def test_the_cycle_finder_finds_cycles():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_loops_in_the_package():
    assert import_cycles(module_graph()) == []


def test_no_module_imports_a_layer_above_its_own():
    graph = module_graph()
    assert len(graph) > 50 and all(layer(m) is not None for m in graph)  # every module is placed
    upward = sorted((m, d) for m, deps in graph.items() for d in deps if layer(d) > layer(m))
    assert upward == []
