"""The package's import structure (docs/design.md, "The package"): every import of an hvdx
module, at module level or inside a function, points to the same layer or one below, and no
modules import each other in a loop, inside packages too. Read from the source (ast), so
lazy imports count as much as eager ones."""
import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

from tests.harness import ROOT

#: The layers, lowest first (docs/design.md). A module belongs to the longest prefix listed.
LAYERS: List[List[str]] = [
    # foundations: no other hvdx module, or only each other's
    ["hvdx.version", "hvdx.arguments", "hvdx.legacy_keras", "hvdx.ops", "hvdx.shm", "hvdx.agreement",
     "hvdx.plateau", "hvdx.mpi_defaults", "hvdx.transport", "hvdx.phases", "hvdx.zoo",
     "hvdx.checkpoints", "hvdx.accumulation", "hvdx.variables", "hvdx.tensorflow._horovod_api", "hvdx.progress",
     "hvdx.stall", "hvdx.timeline"],
    # the run's topology and its progress watchdog; the launchers (on the segment kit's pid_alive)
    ["hvdx.topology", "hvdx.watchdog", "hvdx.runner"],
    # on the topology: node-local collectives, the parallel tensor operator, DataCache, a
    # phased run's measurements
    ["hvdx.node", "hvdx.pto", "hvdx.data", "hvdx.throughput", "hvdx.history"],
    # the aggregation strategies
    ["hvdx.comm"],
    # what aggregates buckets of gradients; the layer-wise optimizers that read the aggregation
    ["hvdx.buckets", "hvdx.aggregator", "hvdx.optimizers"],
    # the wrappers of Horovod's API (the optimizer's Keras-neutral core and its Keras 3 adapter among them)
    ["hvdx.wrapped", "hvdx.optimizer", "hvdx.optimizer_v1", "hvdx.tape", "hvdx.loading", "hvdx.wrapper_core",
     "hvdx.keras3_optimizer"],
    # the protocol of the methods beside the synchronous step
    ["hvdx.lifecycle"],
    # Keras glue that knows no particular method: the callbacks (the one method driver among
    # them), the elastic state
    ["hvdx.callbacks", "hvdx.elastic", "hvdx.keras3_elastic"],
    # the methods, each package whole (its Keras glue, a subclass of the driver, in it)
    ["hvdx.daso", "hvdx.adpsgd", "hvdx.asynchronous", "hvdx.localsgd", "hvdx.streaming_diloco"],
    # Horovod's namespaces and the package's face
    ["hvdx.keras", "hvdx.tensorflow", "hvdx.__init__"],
]


def _modules() -> Dict[str, Path]:
    out = {}
    for path in (ROOT / "hvdx").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts)] = path  # a package's face keeps its __init__: hvdx.daso.__init__
    return out


MODULES = _modules()


def _target(name: str) -> str:
    """The module an imported dotted name lands in (a package: its face)."""
    while name:
        for candidate in (name, f"{name}.__init__"):
            if candidate in MODULES:
                return candidate
        name = name.rpartition(".")[0]
    return ""


def imports(module: str) -> Set[str]:
    """The hvdx modules `module` imports, anywhere in its source."""
    path = MODULES[module]
    package = module.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_target(alias.name) for alias in node.names if alias.name.split(".")[0] == "hvdx")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "hvdx":
                continue
            for alias in node.names:
                submodule = _target(f"{source}.{alias.name}")
                found.add(submodule if submodule.startswith(f"{source}.") else _target(source))
    found.discard(module)
    found.discard("")
    return found


GRAPH = {module: imports(module) for module in MODULES}


def layer(module: str) -> int:
    """The index in LAYERS of the longest prefix of `module` listed there."""
    best, level = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    if level is None:
        raise KeyError(module)
    return level


def test_every_module_has_a_layer():
    missing = []
    for module in MODULES:
        try:
            layer(module)
        except KeyError:
            missing.append(module)
    assert not missing, f"add {missing} to tests/test_layering.py's LAYERS (and docs/design.md's layering)"


def test_no_module_imports_from_a_higher_layer():
    upward = [f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
              for module, targets in sorted(GRAPH.items()) for target in sorted(targets)
              if layer(target) > layer(module)]
    assert not upward, "\n".join(upward)


#: The method packages, and the one each may build on (streaming DiLoCo is LocalSGD's subclass).
METHODS = ["hvdx.daso", "hvdx.adpsgd", "hvdx.asynchronous", "hvdx.localsgd", "hvdx.streaming_diloco"]
EXTENDS = {"hvdx.streaming_diloco": {"hvdx.localsgd"}}


def _method(module: str) -> str:
    return next((m for m in METHODS if module == m or module.startswith(m + ".")), "")


def test_a_method_imports_no_other_method():
    """The methods share one layer and stand on what is below it, never on each other."""
    crossing = [f"{module} imports {target}" for module, targets in sorted(GRAPH.items()) if _method(module)
                for target in sorted(targets)
                if _method(target) not in ("", _method(module)) and _method(target) not in EXTENDS.get(_method(module), ())]
    assert not crossing, "\n".join(crossing)


def test_no_import_cycles():
    """Tarjan's strongly connected components of the import graph: none larger than one module."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    cycles: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not cycles, f"modules importing each other in a loop: {cycles}"


@pytest.mark.parametrize("source, expected", [
    ("from hvdx.comm.base import Strategy", {"hvdx.comm.base"}),
    ("from hvdx import comm", {"hvdx.comm.__init__"}),
    ("import hvdx.daso.optimizer", {"hvdx.daso.optimizer"}),
    ("def f():\n    from hvdx.callbacks import method", {"hvdx.callbacks.method"}),
])
def test_the_reader_sees_every_kind_of_import(tmp_path, monkeypatch, source, expected):
    """The checks above are only as good as the reader: eager, lazy and submodule imports."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "hvdx.probe", path)
    assert imports("hvdx.probe") == expected
