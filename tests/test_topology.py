"""hvdx.init() builds the node-local and cross-node process sets on every topology shape."""
import importlib
import subprocess
import sys

import pytest

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


@suite.runs(suite.check("topology.uneven_flat", "1+2"))
def test_uneven_nodes_run_flat_with_one_warning_when_asked(ranks):
    assert sorted(ranks) == [0, 1, 2]
    assert "127.0.0.1: 2 rank(s) [1, 2]" in ranks[0]["warned"][0] and not ranks[1]["warned"]
    assert all(r["hitopk"] == r["hierarchical"] for r in ranks.values())


def test_uneven_nodes_option_resolves_from_the_environment(monkeypatch):
    topology = importlib.import_module("hvdx.topology")  # (hvdx.topology is the function)
    entries = [(0, 0, 1, "a"), (1, 0, 2, "b"), (2, 1, 2, "b")]
    assert topology._group_nodes(entries, "flat") == ((0,), (1,), (2,))
    monkeypatch.delenv(topology.UNEVEN_NODES_ENV, raising=False)
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    assert topology._resolve_uneven(None) == "error"
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert topology._resolve_uneven(None) == "flat" and topology._resolve_uneven("error") == "error"
    monkeypatch.setenv(topology.UNEVEN_NODES_ENV, "error")
    assert topology._resolve_uneven(None) == "error"
    with pytest.raises(ValueError, match="'error' or 'flat'"):
        topology._resolve_uneven("sometimes")
