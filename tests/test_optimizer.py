"""hvdx.DistributedOptimizer trains like Horovod's, with every aggregation strategy
(tests/multirank/check_optimizer.py)."""
from tests import suite


@suite.runs(*[suite.check("optimizer.training", t, timeout=480) for t in ("2x2", "3x2")])
def test_distributed_optimizer(ranks):
    data = ranks
    accuracy = data[0]["accuracy"]
    print("test accuracy by strategy:", accuracy)
    assert all(data[r]["accuracy"] == accuracy for r in data)
    assert accuracy["allreduce"] > 0.9
