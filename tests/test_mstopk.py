"""MSTopK (shi2021, Algorithm 1) selects exactly k elements, the way Algorithm 1 says.

The kernels answer many bisection rounds per pass over x; tests/mstopk_reference.py runs
Algorithm 1 as written (one counting pass per round). For the window offset the op drew,
both must select the same set, with the same thresholds.
"""
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import hvdx
from hvdx import ops
from tests import mstopk_reference as ref

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
PATTERNS = ["normal", "ties", "zeros", "negative_zeros", "constant", "nonfinite", "outlier",
            "many_nonfinite", "heavy_tail"]


def make_input(pattern: str, d: int, dtype: tf.DType, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(d)
    if pattern == "ties":
        x = np.round(x * 2)
    elif pattern == "zeros":
        x = np.zeros(d)
    elif pattern == "negative_zeros":
        x = np.where(rng.random(d) < 0.5, -0.0, 0.0)
    elif pattern == "constant":
        x = np.full(d, -1.5)
    elif pattern == "nonfinite":
        for value in (np.nan, np.inf, -np.inf):
            x[rng.integers(0, d, max(1, d // 500))] = value
    elif pattern == "many_nonfinite":
        x[rng.random(d) < 0.3] = np.nan
        x[rng.random(d) < 0.1] = -np.inf
    elif pattern == "outlier":
        x = x * 1e-3
        x[rng.integers(0, d)] = 1e4
    elif pattern == "heavy_tail":
        x = rng.standard_cauchy(d)
    with np.errstate(over="ignore"):  # large values become Inf in 16 bits: part of the test
        return tf.constant(x, dtype).numpy()  # rounded to the dtype, as the op sees it


def run_op(x: np.ndarray, k: int, num_samplings: int, dtype: tf.DType):
    values, indices, thresholds = ops._mstopk(tf.constant(x, dtype), tf.constant(k, tf.int64),
                                              num_samplings, None, tf.int32)
    return values.numpy(), indices.numpy().astype(np.int64), thresholds.numpy()


def check_against_reference(x, k, num_samplings, values, indices, thresholds):
    d = x.size
    kk = min(k, d)
    assert indices.size == kk and values.size == kk
    assert np.unique(indices).size == kk, "indices repeat"
    assert np.all((indices >= 0) & (indices < d))
    np.testing.assert_array_equal(values.view(np.uint8), x[indices].view(np.uint8))  # NaN too
    if kk == d:
        np.testing.assert_array_equal(indices, np.arange(d))
        return
    if kk == 0:
        return
    expected = ref.mstopk(x, k, num_samplings, offset=0)
    assert (thresholds[0], thresholds[1]) == (expected.thres1, expected.thres2)
    a = ref.magnitudes(x)
    thres1, thres2 = expected.thres1, expected.thres2
    if np.count_nonzero(a >= thres1) <= kk:
        above = np.flatnonzero(a >= thres1)
        np.testing.assert_array_equal(indices[:above.size], above)  # all of them, in order
        window = indices[above.size:]
    else:  # more than k non-finite: a window of them
        assert np.all(np.isinf(a[indices]))
        window = indices
    assert np.all(a[window] >= thres2), "selected below thres2"
    assert np.all(a[window] < thres1) or window is indices
    if window.size:
        band = expected.band
        start = int(np.searchsorted(band, window[0]))
        np.testing.assert_array_equal(window, band[start:start + window.size])  # contiguous
        same = ref.mstopk(x, k, num_samplings, offset=start)
        np.testing.assert_array_equal(indices, same.indices)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.one_of(st.integers(1, 64), st.integers(65, 20_000), st.sampled_from([10**5, 10**6])),
       k_fraction=st.one_of(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 0.99, 1.0, 1.5]),
                            st.floats(0, 1.2)),
       num_samplings=st.one_of(st.integers(1, 6), st.sampled_from([10, 20, 30, 45])),
       dtype=st.sampled_from(sorted(DTYPES)), pattern=st.sampled_from(PATTERNS),
       seed=st.integers(0, 2**31))
def test_matches_algorithm_1_run_round_by_round(d, k_fraction, num_samplings, dtype, pattern, seed):
    assume(d <= 20_000 or num_samplings <= 30)
    x = make_input(pattern, d, DTYPES[dtype], seed)
    k = int(round(k_fraction * d))
    values, indices, thresholds = run_op(x, k, num_samplings, DTYPES[dtype])
    check_against_reference(x, k, num_samplings, values, indices, thresholds)


@pytest.mark.parametrize("d", [1, 2, 17, 4096, 4097, 70_001])
def test_k_zero_and_k_at_least_d(d):
    x = np.random.default_rng(d).standard_normal(d).astype(np.float32)
    for k in (0, d, d + 5):
        values, indices = hvdx.mstopk(x, k)
        assert values.shape == (min(k, d),) and indices.dtype == tf.int32
        np.testing.assert_array_equal(indices.numpy(), np.arange(min(k, d)))


def test_nonfinite_rank_above_every_finite_value():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    x[[3, 500, 9000]] = [np.nan, np.inf, -np.inf]
    for k in (3, 10, 100):
        _, indices = hvdx.mstopk(x, k)
        assert {3, 500, 9000} <= set(indices.numpy().tolist())
    _, indices = hvdx.mstopk(x, 2)  # more non-finite than k: only non-finite ones
    assert set(indices.numpy().tolist()) < {3, 500, 9000}


def test_selects_the_largest_magnitudes_on_gradient_like_data():
    """With the default 30 rounds the threshold is close: the selection is nearly exact top-k."""
    x = np.random.default_rng(1).standard_normal(1_000_000).astype(np.float32)
    k = 1000
    _, indices = hvdx.mstopk(x, k)
    exact = set(np.argpartition(-np.abs(x), k)[:k].tolist())
    assert len(exact & set(indices.numpy().tolist())) >= 0.99 * k


def test_window_offset_is_uniform_over_every_valid_start():
    # thres1 keeps only the 5; the six 1s form the band (thres2 lies just below 1, above the
    # zeros); k - k1 = 2 of them are chosen: starts 0..4 are valid.
    x = np.array([5.0] + [1.0] * 6 + [0.0] * 20, np.float32)
    starts = []
    band = np.arange(1, 7)
    for _ in range(500):
        _, indices = hvdx.mstopk(x, 3)
        chosen = indices.numpy()
        assert chosen[0] == 0
        starts.append(int(np.searchsorted(band, chosen[1])))
        np.testing.assert_array_equal(chosen[1:], band[starts[-1]:starts[-1] + 2])
    counts = np.bincount(starts, minlength=5)
    assert counts.size == 5 and counts.min() > 50, counts  # 100 expected each


def test_seeded_offsets_repeat():
    x = np.ones(1000, np.float32)

    def draw():
        tf.random.set_seed(7)
        op = tf.function(lambda t: hvdx.mstopk(t, 10, seed=3)[1])
        return [op(x).numpy()[0] for _ in range(5)]

    first = draw()
    assert first == draw() and len(set(first)) > 1


def test_int64_indices_and_dynamic_shapes():
    x = np.random.default_rng(2).standard_normal(5000).astype(np.float32)
    values, indices, _ = ops._mstopk(tf.constant(x), tf.constant(50, tf.int64), 30, None, tf.int64)
    assert indices.dtype == tf.int64
    np.testing.assert_array_equal(values.numpy(), x[indices.numpy()])

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int32)])
    def dynamic(t, k):
        values, indices = hvdx.mstopk(t, k)
        assert values.shape.as_list() == [None]
        return indices

    assert dynamic(x, tf.constant(50)).shape == (50,)


def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="1-D"):
        hvdx.mstopk(np.ones((2, 3), np.float32), 1)
    with pytest.raises(ValueError, match="k must be >= 0"):
        hvdx.mstopk(np.ones(3, np.float32), -1)
    with pytest.raises(ValueError, match="num_samplings"):
        hvdx.mstopk(np.ones(3, np.float32), 1, num_samplings=0)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        hvdx.mstopk(np.ones(3, np.int32), 1)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int64)])
    def dynamic(t, k):
        return hvdx.mstopk(t, k)

    with pytest.raises(tf.errors.InvalidArgumentError, match="k must be >= 0"):
        dynamic(np.ones(3, np.float32), tf.constant(-2, tf.int64))


@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="no GPU on this machine")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_cuda_kernel_matches_cpu_kernel(dtype):
    cases = [(pattern, d, k, n) for pattern in PATTERNS
             for d, k, n in [(1000, 10, 30), (100_000, 100, 30), (1_000_003, 1000, 30), (5000, 4000, 12)]]
    for pattern, d, k, n in cases:
        x = make_input(pattern, d, DTYPES[dtype], seed=d)
        with tf.device("/CPU:0"):
            _, cpu_indices, cpu_thresholds = ops._mstopk(tf.constant(x, DTYPES[dtype]), tf.constant(k, tf.int64), n, None, tf.int32)
        with tf.device("/GPU:0"):
            gpu_values, gpu_indices, gpu_thresholds = ops._mstopk(tf.constant(x, DTYPES[dtype]), tf.constant(k, tf.int64), n, None, tf.int32)
        np.testing.assert_array_equal(gpu_thresholds.numpy(), cpu_thresholds.numpy())
        check_against_reference(x, k, n, gpu_values.numpy(), gpu_indices.numpy().astype(np.int64),
                                gpu_thresholds.numpy())
