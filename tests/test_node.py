"""hvdx.node: the node-local collectives, below the strategies (their behaviour:
tests/test_node_shm.py, tests/test_comm.py, tests/multirank/check_node_shm.py). Here: the
layering holds (hvdx.node on topology, ops and the shm kit only; the kit on no hvdx module)."""
import ast
from pathlib import Path

import pytest

from tests.harness import ROOT


def _hvdx_imports(path: Path):
    """The hvdx modules `path` imports (at the top or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "hvdx"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hvdx":
            found |= {node.module if node.module != "hvdx" else f"hvdx.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("module, allowed", [
    ("hvdx/shm.py", set()),
    ("hvdx/node/__init__.py", {"hvdx.node.collectives", "hvdx.node.shm_engine"}),
    ("hvdx/node/collectives.py", {"hvdx.node", "hvdx.node.shm_engine", "hvdx.topology"}),
    ("hvdx/node/shm_engine.py", {"hvdx.shm", "hvdx.ops", "hvdx.topology"}),
    ("hvdx/asynchronous/shared.py", {"hvdx.shm"}),
])
def test_the_node_modules_and_the_kit_import_nothing_above_them(module, allowed):
    assert _hvdx_imports(ROOT / module) <= allowed
