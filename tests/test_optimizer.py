"""hvdx.DistributedOptimizer trains like Horovod's, with every aggregation strategy
(tests/multirank/check_optimizer.py)."""
from tests import suite


# 14 epochs (~300 steps): the MSTopK strategies end 1.4-2.6 points above their bar (Allreduce's
# accuracy minus 1 point) on both topologies, as much room as 20 epochs left (1.2-1.7 points).
EPOCHS = 14


@suite.runs(*[suite.check("optimizer.training", t, epochs=EPOCHS, timeout=480) for t in ("2x2", "3x2")])
def test_distributed_optimizer(ranks):
    data = ranks
    accuracy = data[0]["accuracy"]
    print("test accuracy by strategy:", accuracy)
    assert all(data[r]["accuracy"] == accuracy for r in data)
    assert accuracy["allreduce"] > 0.9
