"""hvdx.comm strategies average like allreduce, and the sparse ones follow Algorithms 1-2."""
import pytest

from tests import harness

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2)], ids=lambda v: str(v))
def test_strategies_on_hierarchical_topologies(nodes, per_node):
    job = harness.launch("check_comm.py", np=nodes * per_node, hosts=harness.hosts(nodes, per_node),
                         timeout=300)
    assert sorted(job.check()) == list(range(nodes * per_node))
