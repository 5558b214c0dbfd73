"""hvdx.init() builds the node-local and cross-node process sets on every topology shape."""
import subprocess
import sys

from tests import harness, suite

SHAPES = [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2)]


@suite.runs(*[suite.check("topology.check", f"{n}x{m}", nodes=n, per_node=m) for n, m in SHAPES])
def test_every_rank_sees_its_node_and_sets(ranks):
    assert sorted(ranks) == list(range(ranks.topology.np))


def test_single_process_without_launcher(tmp_path):
    """A plain `python script.py` is a 1 x 1 job."""
    proc = subprocess.run([sys.executable, str(harness.MULTIRANK / "suite.py"), "topology.check"],
                          capture_output=True, text=True, timeout=120, cwd=harness.ROOT,
                          env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "rank-0.json").exists()


@suite.runs(suite.check("topology.heterogeneous", "1+2"))
def test_heterogeneous_nodes_fail_clearly_on_every_rank(ranks):
    data = ranks
    assert sorted(data) == [0, 1, 2]
    for rank, result in data.items():
        assert "homogeneous" in result["error"], (rank, result)
        assert "localhost: 1 rank(s) [0]" in result["error"] and "127.0.0.1: 2 rank(s) [1, 2]" in result["error"]
