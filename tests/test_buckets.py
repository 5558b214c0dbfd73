"""Buckets and overlap (issue: "End-to-end training step"; shi2021 Fig. 1): gradients are
aggregated in buckets filled in backpropagation's order, so a bucket's collectives can run
while the backward pass of earlier layers goes on; every strategy gives the same average
with buckets as with one fused buffer, and error feedback, checkpoints and the strategy
switch keep working per bucket.

The checks of tests/multirank/check_buckets.py, on 2 nodes x 2 ranks (the suite's 2x2
launch); timings are measured by benchmarks/train_step.py, never asserted here.
"""
from hvdx.node.collectives import node_slices
from tests import suite

STRATEGIES = ("allreduce", "hierarchical", "hitopk", "sparse_allgather")


def on_2x2(check: str):
    """The test asserts on CHECKS[check] of tests/multirank/check_buckets.py, on 2x2."""
    return suite.runs(suite.check(f"buckets.{check}", "2x2"))


@on_2x2("plans")
def test_buckets_fill_in_backpropagation_order(ranks):
    """Variables (k0, b0, k1, b1, k2, b2) of 2048, 32, 19200, 2400, 24000, 40 bytes: with
    16 KiB buckets the last layer's gradients come first, a gradient of 16 KiB or more goes
    alone (no fused copy of it), a bucket closes once it holds 16 KiB; None fuses all.
    Inside a bucket the gradients keep the variables' order (as in one fused buffer)."""
    for plans in ranks.every():
        assert plans["small"] == [[5], [4], [3], [2], [0, 1]]
        assert plans["medium"] == [[2, 3, 4, 5], [0, 1]]  # 30000 bytes: closes at 45640
        assert plans["fused"] == [[0, 1, 2, 3, 4, 5]]


@on_2x2("bucketed_equals_fused")
def test_every_strategy_averages_the_same_with_buckets_as_fused(ranks):
    for deviations in ranks.every():
        assert sorted(deviations) == sorted(f"{s}/{b}" for s in STRATEGIES + ("hierarchical_sized",)
                                            for b in ("None", "16384", "4096"))
        assert max(deviations.values()) < 1e-6, deviations


@on_2x2("overlap_structure")
def test_first_bucket_does_not_wait_for_the_first_layers_gradient(ranks):
    """The traced train step lets the first bucket's collectives start before
    backpropagation reaches the first layer; only the last bucket waits for it."""
    for structure in ranks.every():
        one_bucket = structure.pop("allreduce_one_bucket")
        assert sorted(structure) == sorted(STRATEGIES)
        for strategy, found in structure.items():
            assert found == {"buckets": 5, "first_waits": False, "last_waits": True}, strategy
        # inside one bucket, "allreduce" sends each gradient as it exists (as Horovod does)
        assert one_bucket == {"collectives": 6, "last_waits": False, "any_waits": True}, one_bucket


@on_2x2("error_feedback_per_bucket")
def test_error_feedback_checkpoints_and_switch_work_per_bucket(ranks):
    for result in ranks.every():
        sizes, n = result["sizes"], result["local_size"]
        buckets = [[5], [4], [3], [2], [0, 1]]
        want = {f"v0_b{b}": node_slices(sum(sizes[i] for i in bucket), n)[0][1] for b, bucket in enumerate(buckets)}
        assert result["lengths"] == want  # one residual per bucket, of its longest node slice on every rank
        assert all(result["written"].values()), result["written"]
        assert result["restored"] and result["resumed"] and result["identical_weights"], result


@on_2x2("zero_size")
def test_a_variable_of_no_elements_beside_a_normal_one_aggregates_on_every_strategy(ranks):
    """Issue 27, item 10, Horovod's behaviour: the zero-size gradient comes back zero-size,
    the other is averaged (mean of rank + 1 over 4 ranks = 2.5); model.fit trains and keeps
    the replicas identical."""
    for result in ranks.every():
        assert sorted(result) == sorted(STRATEGIES)
        for strategy, found in result.items():
            assert found["tape"] == [[2.5, 2.5], []], strategy
            assert found["direct"] == [0] and found["empty"] == [0], strategy
            assert found["losses"][1] < found["losses"][0], strategy
    for strategy in STRATEGIES:
        assert len({tuple(result[strategy]["kernel"]) for result in ranks.every()}) == 1, strategy


def test_slice_ranges_cover_sliced_buckets_and_leave_whole_ones_to_each_rank():
    """A record of 2DTAR's size rule: bucket A (gradients 0 and 1, 10 + 6 elements) was
    reduce-scattered and this rank holds elements [4, 12) of it; bucket B (gradient 2) was
    averaged whole (no slice). Gradient 0 gets [4, 10), gradient 1 [0, 2), gradient 2 no entry
    (its norm is computed whole on every rank). No sliced bucket at all, or a gradient in a
    sliced and a whole bucket: None (the norms fall back to the parallel tensor operator)."""
    import tensorflow as tf

    from hvdx.buckets import AggregationRecord, BucketRecord, Piece
    from hvdx.comm.base import Aggregated

    sliced = BucketRecord(Aggregated(None, local_slice=(tf.zeros([8]), 4)), (Piece(0, 0, 10), Piece(1, 0, 6)))
    whole = BucketRecord(Aggregated(None), (Piece(2, 0, 5),))
    assert AggregationRecord((None,) * 3, (sliced, whole)).slice_ranges() == {0: [(4, 10)], 1: [(0, 2)]}
    assert AggregationRecord((None,) * 3, (whole,)).slice_ranges() is None
    split = BucketRecord(Aggregated(None), (Piece(1, 6, 9),))  # gradient 1's tail in a whole bucket
    assert AggregationRecord((None,) * 3, (sliced, split)).slice_ranges() is None
