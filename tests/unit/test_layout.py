"""The package's layout, checked from its own source: no import circles, small modules, rooms that import downward.

Imports are read with ``ast`` (nothing is imported): every ``import`` and ``from ... import`` of a
``workbench`` module, at module level, inside a function (a lazy import still ties two modules
together) or under ``if TYPE_CHECKING:`` (a reader follows a type-only import too).
``from package import name`` counts as an import of the module ``package.name`` where that is a
module the package's ``__init__`` does not bind a name over, else of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "workbench"
MAX_LINES = 500
MAX_CLUSTER_TOP = 10  # modules directly in workbench/cluster/, __init__.py included
MAX_TRAINING_TOP = 10  # modules directly in workbench/training/, __init__.py included
MAX_TRAINING_LINES = 400  # the room every new capability touches stays in smaller modules
# workbench/cluster/'s rooms, top to bottom: each may import the rooms below it, never one above or beside it
CLUSTER_ROOMS = {"face": {"launch", "network", "process", "machine"}, "launch": {"process", "machine"},
                 "network": {"process", "machine"}, "process": {"machine"}, "machine": set()}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "labextension" in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _import_nodes(node: ast.AST):
    """Every import statement under ``node``, wherever it is (type-only ones too)."""
    return (n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _bound_in_init(package: str) -> set[str]:
    """Names a package's ``__init__`` binds by importing them (they shadow its submodules of the same name)."""
    path = MODULES.get(package)
    if path is None or path.name != "__init__.py":
        return set()
    return {a.asname or a.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.ImportFrom) and (n.module or n.level != 1) for a in n.names}  # not `from . import sub`


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The workbench modules ``module`` imports."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            bound = _bound_in_init(base)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES and a.name not in bound else base
                     for a in node.names]
        targets |= {t for t in map(_resolve, (n for n in names if n.split(".")[0] == "workbench")) if t and t != module}
    return targets


GRAPH = {module: imports_of(module) for module in MODULES}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each as a path that closes on itself."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

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
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_walker_sees_lazy_and_type_only_imports():
    # the walker itself, on the package's own files and on a snippet: a function-level import is an edge, and so
    # is a type-only one
    assert "workbench.cluster.launch.engine_side" in GRAPH["workbench.telemetry.profiler"]  # imported in a function
    snippet = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .model import PlacedModel\n")
    assert [n.module for n in _import_nodes(snippet)] == ["typing", "model"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    circles = _circles(GRAPH)
    detail = "; ".join(" <-> ".join(group) for group in circles)
    assert not circles, f"import circles (move what both sides need to a module both import): {detail}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES}): split it by what its parts do"


def test_cluster_top_level_is_its_face():
    top = sorted(p.name for p in (PACKAGE / "cluster").glob("*.py"))
    assert len(top) <= MAX_CLUSTER_TOP, f"workbench/cluster/ holds {len(top)} modules: {top}"
    rooms = sorted(p.name for p in (PACKAGE / "cluster").iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(set(CLUSTER_ROOMS) - {"face"})


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["workbench", "cluster"]:
        return None
    if len(parts) > 3 or (len(parts) == 3 and MODULES[module].name == "__init__.py"):
        return parts[2]
    return "face"


def test_cluster_rooms_import_downward():
    wrong = [f"{module} -> {target}" for module, targets in sorted(GRAPH.items()) for target in sorted(targets)
             if _room(module) and _room(target) and _room(target) != _room(module)
             and _room(target) not in CLUSTER_ROOMS[_room(module)]]
    assert not wrong, "imports against the direction face -> launch/network -> process -> machine: " + "; ".join(wrong)


@pytest.mark.parametrize("room", sorted(set(CLUSTER_ROOMS) - {"face"}))
def test_each_room_says_what_it_owns(room):
    doc = ast.get_docstring(ast.parse((PACKAGE / "cluster" / room / "__init__.py").read_text())) or ""
    assert "import" in doc and len(doc) > 200, f"cluster/{room}/__init__.py must say what it owns and may import"


def test_no_submodule_imports_the_package_itself():
    # `from .. import x` inside workbench ties every module to workbench/__init__.py, which imports them all
    offenders = sorted(m for m, targets in GRAPH.items() if "workbench" in targets and m != "workbench")
    assert not offenders, f"import from workbench's own modules instead of the package: {offenders}"


def test_compat_imports_no_other_workbench_module_but_errors():
    # the fence around other libraries' internals sits below everything: any room may use it, it uses none
    wrong = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if m.startswith("workbench.compat")
                   for t in targets if not t.startswith("workbench.compat") and t != "workbench.errors")
    assert not wrong, f"workbench/compat/ must import only the libraries it fences (and workbench.errors): {wrong}"


INTERNAL = ("tensorflow.python", "tensorflow.tsl", "tensorflow.core.function", "keras.src", "pywrap_tfe", "ipyparallel.traitlets")


def _internal_uses(module: str) -> list[str]:
    """Imports of (and names of) a fenced library's internal modules in ``module``'s source."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        found += [f"{module}:{node.lineno}: {name}" for name in names if name.startswith(INTERNAL)]
    return found


def test_internal_modules_of_other_libraries_are_used_only_behind_the_fence():
    wrong = [use for module in sorted(MODULES) if not module.startswith("workbench.compat") for use in _internal_uses(module)]
    assert not wrong, "use them through workbench/compat/ (one function each, with the versions checked): " + "; ".join(wrong)
    assert _internal_uses("workbench.compat.tensorflow") and _internal_uses("workbench.compat.keras")  # the walker sees them


STRATEGY_NAMES = {"async-ps", "sync-ps", "allreduce", "model-parallel"}
REGISTRY = "workbench.training.config"


def _strategy_name_comparisons(source: str) -> list[int]:
    """Lines comparing something with a strategy's name (``== "sync-ps"``, ``in ("async-ps", ...)``, a match case)."""
    def names_in(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Constant) and n.value in STRATEGY_NAMES for n in ast.walk(node))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(names_in(part) for part in (node.left, *node.comparators)):
            found.append(node.lineno)
        elif isinstance(node, ast.match_case) and names_in(node.pattern):
            found.append(node.pattern.lineno)
    return found


def test_strategies_are_told_apart_only_in_their_registry():
    # what differs between strategies is said by the strategy objects (config.py), not by switches on their names
    wrong = [f"{module}:{line}" for module in sorted(MODULES) if module != REGISTRY
             for line in _strategy_name_comparisons(MODULES[module].read_text())]
    assert not wrong, f"compare strategies through their objects' attributes, not their names: {wrong}"
    assert _strategy_name_comparisons('if strategy in ("async-ps", "sync-ps"): pass') == [1]  # the walker sees them


TRAINING_ROOMS = {"face": {"strategies", "job", "fit", "modelling", "base"}, "strategies": {"job", "fit", "modelling", "base"},
                  "job": {"fit", "modelling", "base"}, "fit": {"modelling", "base"}, "modelling": {"base"}, "base": set()}
TRAINING_BASE = {"config", "options", "data"}  # pure declarations every room may use


def _training_room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["workbench", "training"] or len(parts) < 3:
        return None
    if len(parts) == 3 and MODULES[module].name != "__init__.py":
        return "base" if parts[2] in TRAINING_BASE else "face"
    return parts[2]


def test_training_top_level_holds_its_face_and_rooms():
    top = sorted(p.name for p in (PACKAGE / "training").glob("*.py"))
    assert len(top) <= MAX_TRAINING_TOP, f"workbench/training/ holds {len(top)} modules: {top}"
    rooms = sorted(p.name for p in (PACKAGE / "training").iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(set(TRAINING_ROOMS) - {"face", "base"})


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("workbench.training")))
def test_training_modules_stay_under_its_own_cap(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_TRAINING_LINES, f"{module} has {lines} lines (at most {MAX_TRAINING_LINES} in training/)"


def test_training_rooms_import_downward():
    wrong = [f"{module} -> {target}" for module, targets in sorted(GRAPH.items()) for target in sorted(targets)
             if _training_room(module) and _training_room(target) and _training_room(target) != _training_room(module)
             and _training_room(target) not in TRAINING_ROOMS[_training_room(module)]]
    assert not wrong, ("imports against the direction face -> strategies -> job -> fit -> modelling -> "
                       "config/options/data: " + "; ".join(wrong))


@pytest.mark.parametrize("room", sorted(set(TRAINING_ROOMS) - {"face", "base"}))
def test_each_training_room_says_what_it_owns(room):
    doc = ast.get_docstring(ast.parse((PACKAGE / "training" / room / "__init__.py").read_text())) or ""
    assert "import" in doc and len(doc) > 200, f"training/{room}/__init__.py must say what it owns and may import"


def _private_reads(module: str) -> int:
    """Reads of ``obj._name`` in ``module`` where ``_name`` is not the module's own (not set on ``self`` there, nor
    defined there) and ``obj`` is not ``self``, ``cls``, ``super()`` or an imported module (``os._exit``)."""
    return _count_private_reads(ast.parse(MODULES[module].read_text()))


def _count_private_reads(tree: ast.AST) -> int:
    own, imported = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.Import):
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    count = 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        value = node.value
        if isinstance(value, ast.Name) and (value.id in ("self", "cls") or value.id in imported):
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            continue
        count += node.attr not in own
    return count


def test_no_module_reads_another_modules_private_attributes():
    # a strategy's trainer reads its job's public side, a cluster's rooms (hosting, sharing, links) the cluster's:
    # every interface between modules is explicit. workbench/compat/, the fence, reads other libraries' by design.
    found = {m: n for m in sorted(MODULES) if not m.startswith("workbench.compat") and (n := _private_reads(m))}
    assert not found, f"reads of other modules' private attributes (obj._name): give them a public interface: {found}"
    source = "def f(job):\n    return job._fns, self._own, os._exit\nimport os\n"
    assert _count_private_reads(ast.parse(source)) == 1  # the walker sees them (job._fns), not self's nor a module's
