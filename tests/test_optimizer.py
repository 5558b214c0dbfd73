"""hvdx.DistributedOptimizer trains like Horovod's, with every aggregation strategy."""
import pytest

from tests import harness

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2)], ids=lambda v: str(v))
def test_distributed_optimizer(nodes, per_node):
    job = harness.launch("check_optimizer.py", np=nodes * per_node, hosts=harness.hosts(nodes, per_node),
                         timeout=480)
    data = job.check()
    accuracy = data[0]["accuracy"]
    print("test accuracy by strategy:", accuracy)
    assert all(data[r]["accuracy"] == accuracy for r in data)
    assert accuracy["allreduce"] > 0.9
