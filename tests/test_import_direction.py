"""Every module imports only from its own floor or the floors below, and no imports form a cycle.

The floors, lowest first (``FLOORS``): the kernel library, the config, the device cache, the
attention dispatch, the host-side manager beside the model and sampling, what builds on the
model (speculative decoding, sharding, metrics), the engine, what builds on the engine
(snapshots, CacheBlend), the test helpers, and the experiments with their configs. Packages on
one floor are independent: neither imports the other (the manager never imports the model).

``pallas_kernels`` imports nothing from ``kvjax``, ``experiments``, ``configs`` or ``tests``.
An experiment module (one a config names in ``config.experiment``) imports no other experiment
module: what two experiments share lives in ``experiments/workloads`` or the library.

Imports under ``if TYPE_CHECKING:`` never run, so they take part in the floor rule but not in
the cycle check; every other import (module level or inside a function) takes part in both.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("kvjax", "pallas_kernels", "experiments")
PROJECT = ("kvjax", "pallas_kernels", "experiments", "configs", "tests")

FLOORS: tuple[tuple[str, ...], ...] = (
    ("pallas_kernels",),
    ("kvjax", "kvjax.config", "kvjax.paths", "kvjax.axes", "kvjax.heap"),
    ("kvjax.cache",),
    ("kvjax.attention",),
    ("kvjax.manager", "kvjax.model", "kvjax.sampling"),
    ("kvjax.speculative", "kvjax.distributed", "kvjax.metrics"),
    ("kvjax.engine",),
    ("kvjax.snapshot", "kvjax.blend"),
    ("kvjax.testing",),
    ("experiments", "configs"),
)
"""Allowed order, lowest first. An entry owns itself and every module below it, except the bare
``kvjax`` (the package's own ``__init__``), which owns only itself."""


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _imports(path: pathlib.Path) -> list[tuple[str, bool, int]]:
    """(imported project module, type-only, line) for every import in ``path``; ``from A import
    B`` names module ``A.B`` when that is a module, else ``A``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = _type_checking_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PROJECT:
                out.append((target, id(node) in type_only, node.lineno))
    return out


def _graph() -> dict[str, list[tuple[str, bool, int]]]:
    graph = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            graph[_module_name(path)] = _imports(path)
    return graph


def _floor(module: str) -> tuple[int, str] | None:
    """(floor index, owning entry) of ``module``: the longest entry it is or lies under (None: no floor)."""
    best: tuple[int, str] | None = None
    for i, entries in enumerate(FLOORS):
        for entry in entries:
            owns = module == entry or (entry != "kvjax" and module.startswith(entry + "."))
            if owns and (best is None or len(entry) > len(best[1])):
                best = (i, entry)
    return best


def _experiment_modules() -> set[str]:
    names = set()
    for path in (ROOT / "configs").glob("*.py"):
        names.update(re.findall(r"""config\.experiment\s*=\s*["'](\w+)["']""", path.read_text()))
    return {f"experiments.{name}" for name in names}


def test_every_import_points_down_or_sideways_within_its_own_package():
    wrong = []
    graph = _graph()
    named = set(graph) | {target for imports in graph.values() for target, _, _ in imports}
    unplaced = sorted(m for m in named if _floor(m) is None)
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"
    for module, imports in graph.items():
        floor, entry = _floor(module)
        for target, _, line in imports:
            if module.startswith("pallas_kernels") and not target.startswith("pallas_kernels"):
                wrong.append(f"{module}:{line} imports {target}: pallas_kernels imports only itself")
                continue
            target_floor, target_entry = _floor(target)
            if target_floor > floor:
                wrong.append(f"{module}:{line} imports {target} from a floor above ({target_entry} over {entry})")
            elif target_floor == floor and target_entry != entry and floor != len(FLOORS) - 1:
                wrong.append(f"{module}:{line} imports {target}: {entry} and {target_entry} share a floor")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {
        m: sorted({t for t, type_only, _ in imports if not type_only and t != m}) for m, imports in _graph().items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_no_experiment_imports_another():
    experiments = _experiment_modules()
    assert "experiments.eviction" in experiments and "experiments.bench_manager" in experiments
    graph = _graph()
    wrong = [f"{m}:{line} imports {t}" for m in experiments for t, _, line in graph.get(m, ())
             if t in experiments and t != m]
    assert not wrong, "\n".join(wrong)


def test_a_package_that_imports_a_floor_above_is_refused():
    assert _floor("kvjax.manager.manager") == (4, "kvjax.manager")
    assert _floor("kvjax.cache.pool")[0] < _floor("kvjax.manager.tiers")[0] < _floor("kvjax.engine")[0]
    assert _floor("pallas_kernels.paged_attention.tpu")[0] == 0
    assert _floor("experiments.workloads.rag")[0] == len(FLOORS) - 1
