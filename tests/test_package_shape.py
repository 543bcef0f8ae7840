"""The shape of the package: no import cycle (lazy imports included), and nothing inside it
imports the package face, so each module can be read and tested on its own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tfmem_widgets"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):  # every import, at any depth (lazy ones too)
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # `from X import name`: the module X.name where there is one, else X itself
                targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem
                           for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                while target and target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target in modules and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def test_nothing_inside_the_package_imports_its_face():
    graph = _imports()
    assert [m for m, deps in graph.items() if "tfmem_widgets" in deps] == []


def test_there_is_no_import_cycle():
    graph = {m: deps - {"tfmem_widgets"} for m, deps in _imports().items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
