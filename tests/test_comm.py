"""hvdx.comm strategies average like allreduce, and the sparse ones follow Algorithms 1-2
(tests/multirank/check_comm.py asserts on every rank)."""
from tests import suite


@suite.runs(suite.check("comm.strategies", "2x2"), suite.check("comm.strategies", "3x2"))
def test_strategies_on_hierarchical_topologies(ranks):
    assert sorted(ranks) == list(range(ranks.topology.np))
