"""hvdx.init() builds the node-local and cross-node process sets on every topology shape."""
import subprocess
import sys

import pytest

from tests import harness

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("nodes,per_node", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2)],
                         ids=lambda v: str(v))
def test_every_rank_sees_its_node_and_sets(nodes, per_node):
    job = harness.launch("check_topology.py", "--nodes", str(nodes), "--ranks-per-node", str(per_node),
                         np=nodes * per_node, hosts=harness.hosts(nodes, per_node))
    data = job.check()
    assert sorted(data) == list(range(nodes * per_node))


def test_single_process_without_launcher(tmp_path):
    """A plain `python script.py` is a 1 x 1 job."""
    proc = subprocess.run([sys.executable, str(harness.MULTIRANK / "check_topology.py")],
                          capture_output=True, text=True, timeout=120, cwd=harness.ROOT,
                          env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "rank-0.json").exists()


def test_heterogeneous_nodes_fail_clearly_on_every_rank():
    job = harness.launch("check_topology.py", "--expect-heterogeneous",
                         np=3, hosts=harness.host_list([1, 2]))
    data = job.check()
    assert sorted(data) == [0, 1, 2]
    for rank, result in data.items():
        assert "homogeneous" in result["error"], (rank, result)
        assert "localhost: 1 rank(s) [0]" in result["error"] and "127.0.0.1: 2 rank(s) [1, 2]" in result["error"]
