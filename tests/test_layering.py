"""The floors of DESIGN §1: each package imports only the floors below it, with no import
circle between modules, deferred imports included (``TYPE_CHECKING`` blocks excepted)."""

from __future__ import annotations

import ast
from pathlib import Path

import opmux

_ROOT = Path(opmux.__file__).parent

#: package (first name under opmux) → floor; a package imports only lower floors or itself.
#: ``None`` is the facade (``opmux/__init__.py``): what the testing kit and the CLI use.
FLOORS: dict[str | None, float] = {
    "core": 0,
    "platforms": 1,
    "ops": 2,
    "distributed": 3, "_runtime": 3,
    "layers": 4, "plugins": 4,
    "models": 5, "integrations": 5,
    None: 5.5,
    "testing": 6,
    "cli": 7,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The opmux modules ``path`` imports, at any depth, type-checking imports excluded."""
    package = _module_name(path) if path.name == "__init__.py" else \
        _module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:  # relative: from . import x, from .mod import y
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if not module.startswith("opmux"):
                continue
            submodules = {f"{module}.{a.name}" for a in node.names} & modules
            found.update(submodules)
            if len(submodules) < len(node.names):  # a name of the module itself
                found.add(module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in _ROOT.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) - {name} for name, path in files.items()}


def _floor(module: str) -> float:
    parts = module.split(".")
    return FLOORS[None if len(parts) == 1 else parts[1]]


def test_every_package_has_a_floor() -> None:
    packages: set[str | None] = {m.split(".")[1] for m in _graph() if "." in m}
    assert packages <= set(FLOORS), f"give {sorted(packages - set(FLOORS))} a floor"


def test_packages_import_only_lower_floors() -> None:
    wrong = []
    for module, deps in sorted(_graph().items()):
        floor = _floor(module)
        for dep in sorted(deps):
            dep_floor = _floor(dep)
            if dep.split(".")[1:2] == module.split(".")[1:2]:
                continue  # a package imports itself
            if dep_floor >= floor:
                wrong.append(f"{module} (floor {floor}) -> {dep} (floor {dep_floor})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_core_knows_no_platform_catalog_or_plugin_code() -> None:
    core = {m: d for m, d in _graph().items() if m.startswith("opmux.core")}
    assert not {d for deps in core.values() for d in deps if not d.startswith("opmux.core")}
