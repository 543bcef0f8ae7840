"""The shape of the package: layers as folders, data flowing one way. No import cycle (lazy imports
included); nothing inside it imports the package face; only the notebook layer imports IPython or
ipywidgets, and nothing but the face and the notebook layer imports the notebook layer; no module
over 500 lines; a few modules at the top, each folder saying in its first line what it decides."""

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


def _outside_imports() -> dict[str, set[str]]:
    """The top-level names of what each module imports from outside the package (lazy imports too)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names.add((node.module or "").split(".")[0])
            elif isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
        found[_module_name(path)] = names
    return found


NOTEBOOK_LAYER = "tfmem_widgets.notebook"


def _in_notebook_layer(module: str) -> bool:
    return module == NOTEBOOK_LAYER or module.startswith(NOTEBOOK_LAYER + ".")


def test_only_the_notebook_layer_imports_ipython_or_ipywidgets():
    outside = {m: names & {"IPython", "ipywidgets", "ipykernel", "traitlets"}
               for m, names in _outside_imports().items() if not _in_notebook_layer(m)}
    assert {m: names for m, names in outside.items() if names} == {}


def test_the_core_never_reaches_into_the_notebook_layer():
    # The face registers the extension (lazily); every other module outside the layer stays out of it.
    reaching = {m: sorted(d for d in deps if _in_notebook_layer(d)) for m, deps in _imports().items()
                if not _in_notebook_layer(m) and m != "tfmem_widgets"}
    assert {m: deps for m, deps in reaching.items() if deps} == {}


def test_modules_are_short_and_few_at_the_top_and_each_folder_says_what_it_decides():
    lengths = {_module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {m: n for m, n in lengths.items() if n > 500} == {}
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top
    for folder in (p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        assert init.exists(), folder
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{folder.name}/__init__.py must say what the folder decides"


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
