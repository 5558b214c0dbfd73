"""The parallel tensor operator (shi2021 sec. 4.2, eqs. 12-14): shares balanced by element
count, deterministic; results equal to the replicated computation, in one process and on
3 nodes x 2 ranks (tests/multirank/check_lars.py in the suite's 3x2 launch; 2 x 2 in test_lars.py)."""
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.lars import resnet50_shapes, transformer_base_shapes
import hvdx
from hvdx import pto
from hvdx.buckets import AggregationRecord, BucketRecord, Piece
from hvdx.optimizers.layerwise import squared_norm
from tests import suite


def sizes_of(shapes):
    return [int(np.prod(s)) for s in shapes]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10 ** 7), min_size=0, max_size=300), st.integers(1, 200),
       st.integers(0, 100_000))
def test_shares_cover_every_tensor_once_and_are_balanced(sizes, parts, overhead):
    shares = pto.partition(sizes, parts, overhead)
    assert len(shares.parts) == parts
    assert sorted(i for part in shares.parts for i in part) == list(range(len(sizes)))
    costs = [s + overhead for s in sizes]
    assert list(shares.loads) == [sum(costs[i] for i in part) for part in shares.parts]
    if sizes:  # LPT: at most 4/3 of the optimum, which is at least the mean and the largest
        assert max(shares.loads) <= 4 / 3 * max(sum(costs) / parts, max(costs)) + 1e-9
    assert pto.partition(sizes, parts, overhead) == shares  # deterministic


def test_more_ranks_than_tensors_leaves_empty_shares():
    shares = pto.partition([10, 1000, 5], 6)
    assert sorted(len(p) for p in shares.parts) == [0, 0, 0, 1, 1, 1]
    assert shares.width == 1 and shares.owner()[1][1] == 0


def test_resnet50_shares_are_balanced_where_splitting_by_layer_is_lopsided():
    """The paper gives each GPU consecutive layers; by element count LPT balances 161 tensors
    of 64 to 2.4M elements almost perfectly on 4 ranks."""
    sizes = sizes_of(resnet50_shapes())
    assert len(sizes) == 161 and sum(sizes) == 25_557_032
    shares = pto.partition(sizes, 4)
    assert shares.imbalance < 1.01
    by_layer = [sum(sizes[p * 161 // 4:(p + 1) * 161 // 4]) for p in range(4)]  # consecutive, equal counts
    assert max(by_layer) / (sum(sizes) / 4) > 1.5
    transformer = [n + pto.OP_OVERHEAD_ELEMENTS for n in sizes_of(transformer_base_shapes())]
    shares = pto.partition(transformer, 4, overhead=0)  # the 18.9M embedding alone is 1.13x the mean:
    assert max(shares.loads) == max(transformer)        # whole tensors cannot do better, and LPT does that


def test_element_ranges_cover_the_tensor_in_aligned_pieces():
    for length, parts in [(0, 3), (1, 4), (1001, 4), (4096, 4), (10, 16)]:
        ranges = pto.element_ranges(length, parts)
        assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == length
        assert all(a <= b and (a % 16 == 0 or a == length) for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(parts - 1))


def test_one_rank_computes_everything_as_the_replicated_op():
    rng = np.random.default_rng(0)
    tensors = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in [(3, 4), (1,), (1000,)]]
    got = pto.parallel_map(lambda t: tf.stack([squared_norm(t), tf.reduce_max(t)]), tensors, output_shape=[2])
    want = [[np.sum(t.numpy().astype(np.float64) ** 2), t.numpy().max()] for t in tensors]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    assert pto.parallel_map(squared_norm, []).shape == (0,)
    x = tf.constant(rng.standard_normal((5, 7)).astype(np.float32))
    np.testing.assert_array_equal(pto.parallel_elementwise(tf.abs, x).numpy(), np.abs(x.numpy()))


@pytest.mark.parametrize("call,argument", [
    (lambda: pto.partition([1, 2], 0), "parts"),
    (lambda: pto.partition([1, -2], 2), "sizes"),
    (lambda: pto.partition([1], 2, overhead=-1), "overhead"),
    (lambda: pto.element_ranges(-1, 2), "length"),
])
def test_bad_input_names_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def _aggregated(length, offset):
    return hvdx.comm.Aggregated(None, local_slice=(tf.zeros([length]), offset))


def slice_ranges(buckets):
    record = AggregationRecord((), tuple(BucketRecord(result, tuple(Piece(*p) for p in pieces))
                                         for result, pieces in buckets))
    return record.slice_ranges()


def test_slice_ranges_map_a_padded_slice_back_to_variables():
    """A bucket of gradients 0 (6 elements) and 1 (5), padded to 12 for a node of 2 ranks:
    rank 1's slice [6, 12) covers all of gradient 1 and none of 0; gradient 2 spans two
    buckets, and rank 0 holds the first half of each."""
    pieces = [(0, 0, 6), (1, 0, 5)]
    assert slice_ranges([(_aggregated(6, 6), pieces)]) == {0: [], 1: [(0, 5)]}
    assert slice_ranges([(_aggregated(6, 0), pieces)]) == {0: [(0, 6)], 1: []}
    spanning = [(_aggregated(4, 0), [(2, 0, 8)]), (_aggregated(3, 0), [(2, 8, 10), (3, 0, 4)])]
    assert slice_ranges(spanning) == {2: [(0, 4), (8, 10), ], 3: [(0, 1)]}
    assert slice_ranges([(hvdx.comm.Aggregated(None), pieces)]) is None


@suite.runs(suite.check("lars.pto", "3x2"))
def test_pto_on_3x2(ranks):
    for rank in ranks.values():
        assert rank["topology"] == [3, 2]
        assert rank["counts"] == [1, 2, 3, 5, 8, 13, 161, 300]  # bit-exact, fewer and more tensors than ranks


@suite.runs(suite.check("lars.modes", "3x2"))
def test_parallel_modes_on_3x2(ranks):
    for rank in ranks.values():
        modes = rank["lars.hierarchical"]
        assert modes["modes"] == {"None": None, "pto": "pto", "slices": "slices"}
        assert modes["pto_error"] == 0.0 and modes["slices_error"] < 1e-4
