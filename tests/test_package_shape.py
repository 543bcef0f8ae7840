"""The shape of the package: layers as folders in a declared order, data flowing one way. A folder
imports only the folders before it (lazy imports included); no import cycle; nothing inside it imports
the package face; no module global is assigned from another module; only the notebook layer imports
IPython or ipywidgets; no module over 500 lines and no function over 80; a few modules at the top,
each folder saying in its first line what it decides."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tfmem_widgets"

# The folders, lowest first: each imports only those before it. The modules at the top beside the face
# (errors, units, text, frontend) are the shared ground every folder may import, and import no folder.
ORDER = ("tf", "readings", "views", "plans", "tracing", "oom", "deaths", "fresh", "search", "notebook")
GROUND = ("errors", "units", "text", "frontend")
FACE = ("tfmem_widgets", "tfmem_widgets.keras")


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
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


def _folders() -> list[Path]:
    """The package's folders that hold code (a folder left with only __pycache__ after a move is none)."""
    return [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))]


def _folder(module: str) -> str | None:
    """The folder of ORDER a module is in; None for the face and the ground."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] not in ("keras", *GROUND)) else None


def _order_violations(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import that goes against ORDER: a folder importing one after it (or one not in
    ORDER), the ground importing a folder."""
    found = []
    for module, deps in sorted(graph.items()):
        if module in FACE or module.split(".")[0] != "tfmem_widgets":
            continue
        mine = _folder(module)
        for dep in sorted(deps):
            theirs = _folder(dep)
            if dep in FACE:
                continue
            if theirs is None:
                continue  # the ground: open to every folder
            if mine is None:
                found.append(f"{module} -> {dep} (the ground imports no folder)")
            elif mine not in ORDER or theirs not in ORDER:
                found.append(f"{module} -> {dep} (a folder not in ORDER)")
            elif ORDER.index(theirs) > ORDER.index(mine):
                found.append(f"{module} -> {dep} ({mine} comes before {theirs})")
    return found


def _assignments_from_outside(package: Path = PACKAGE) -> list[str]:
    """'path:line module.name' for each module global assigned from another module (`mod.name = ...`,
    `setattr(mod, ...)`, `del mod.name`), where `mod` is a module of the package imported by name."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here.split(".")[: len(here.split(".")) - (node.level - 1)] + ([base] if base else []))
                aliases.update(a.asname or a.name for a in node.names if f"{base}.{a.name}" in modules)
            elif isinstance(node, ast.Import):
                aliases.update((a.asname or a.name).split(".")[0] for a in node.names if a.name in modules)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases:
                found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.func.id}({node.args[0].id}, ...)")
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id in aliases:
                        found.append(f"{path.relative_to(package.parent)}:{part.lineno} {part.value.id}.{part.attr}")
    return found


def _long_functions(package: Path = PACKAGE, most: int = 80) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > most:
                found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} "
                             f"({node.end_lineno - node.lineno + 1} lines)")
    return found


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
    for folder in _folders():
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


def test_each_folder_imports_only_the_folders_before_it():
    assert sorted(p.name for p in _folders() if p.parent == PACKAGE) == sorted(ORDER)
    assert _order_violations(_imports()) == []


def test_no_module_global_is_assigned_from_another_module():
    assert _assignments_from_outside() == []


def test_no_function_is_longer_than_80_lines():
    assert _long_functions() == []


def test_the_shape_checks_find_what_is_planted(tmp_path):
    """The checks above on a made-up package that breaks each rule once."""
    package = tmp_path / "tfmem_widgets"
    for folder in ("tf", "oom", "notebook"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "units.py").write_text("from .oom import report\n")  # the ground reaching into a folder
    (package / "tf" / "limits.py").write_text("def f():\n    from ..oom.report import OomReport\n")
    (package / "oom" / "report.py").write_text("from ..tf import limits\nfrom ..tf.limits import f\nOomReport = 1\n")
    (package / "notebook" / "extension.py").write_text(
        "from ..oom import report\nimport tfmem_widgets.tf.limits\n\ndef load():\n    report.hook = 1\n"
        "    setattr(report, 'other', 2)\n\ndef long():\n" + "    x = 1\n" * 80)
    graph = _imports(package)
    assert _order_violations(graph) == [
        "tfmem_widgets.tf.limits -> tfmem_widgets.oom.report (tf comes before oom)",
        "tfmem_widgets.units -> tfmem_widgets.oom.report (the ground imports no folder)",
    ]
    assert _assignments_from_outside(package) == ["tfmem_widgets/notebook/extension.py:5 report.hook",
                                                  "tfmem_widgets/notebook/extension.py:6 setattr(report, ...)"]
    assert _long_functions(package) == ["tfmem_widgets/notebook/extension.py:8 long (81 lines)"]
