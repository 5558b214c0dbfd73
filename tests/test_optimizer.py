"""hvdx.DistributedOptimizer trains like Horovod's, with every aggregation strategy."""
import pytest

from tests import harness

pytestmark = pytest.mark.multirank


def test_distributed_optimizer_on_2_nodes_x_2_ranks():
    job = harness.launch("check_optimizer.py", np=4, hosts=harness.hosts(2, 2), timeout=420)
    data = job.check()
    accuracy = data[0]["accuracy"]
    print("test accuracy by strategy:", accuracy)
    assert all(data[r]["accuracy"] == accuracy for r in data)
    assert accuracy["allreduce"] > 0.9
