"""MSTopK (shi2021, Algorithm 1) selects exactly k elements, the way Algorithm 1 says.

The kernels answer many bisection rounds per pass over x; tests/mstopk_reference.py runs
Algorithm 1 as written (one counting pass per round). For the window offset the op drew,
both must select the same set, with the same thresholds.
"""
import os
import subprocess
import sys

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
            "many_nonfinite", "heavy_tail", "student_t", "many_zeros", "huge_ratio", "layered", "lognormal"]
# Distributions of real gradients: heavy tails, where max(|x|) >> mean(|x|).
HEAVY = ["student_t", "heavy_tail", "layered", "lognormal", "huge_ratio", "many_zeros"]


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
    elif pattern == "student_t":
        x = rng.standard_t(3, d)
    elif pattern == "many_zeros":  # 90 % exact zeros (dead units), heavy tail in the rest
        x = np.where(rng.random(d) < 0.9, 0.0, rng.standard_t(2, d))
    elif pattern == "huge_ratio":  # max / mean ~ 1e7
        x = x * 1e-4
        x[rng.integers(0, d, max(1, d // 10_000))] *= 1e6
    elif pattern == "layered":  # a flattened gradient: blocks ("layers") of very different scales
        edges = np.sort(rng.integers(0, d, 12))
        for lo, hi in zip(np.r_[0, edges], np.r_[edges, d]):
            x[lo:hi] *= 10.0 ** rng.uniform(-5, 2)
    elif pattern == "lognormal":
        x = rng.lognormal(0, 3, d) * rng.choice([-1, 1], d)
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


def test_stateless_offsets_are_a_function_of_the_seed_alone():
    """What a resumed run needs: the same (x, k, seed) select the same elements whatever ran
    before; other seeds move the window uniformly over its valid starts; the selection is
    Algorithm 1's for the offset drawn."""
    x = np.array([5.0] + [1.0] * 6 + [0.0] * 20, np.float32)  # as above: band 1..6, 2 chosen
    band = np.arange(1, 7)
    first = [ops.stateless_mstopk(x, 3, [11, step])[1].numpy() for step in range(400)]
    hvdx.mstopk(x, 3)  # a stateful draw in between changes nothing

    @tf.function
    def again(t, step):
        return ops.stateless_mstopk(t, 3, tf.stack([tf.constant(11, tf.int64), step]))[1]

    for step in (0, 7, 399):
        np.testing.assert_array_equal(again(x, tf.constant(step, tf.int64)).numpy(), first[step])
    starts = [int(np.searchsorted(band, chosen[1])) for chosen in first]
    for chosen, start in zip(first, starts):
        assert chosen[0] == 0
        np.testing.assert_array_equal(chosen[1:], band[start:start + 2])
    counts = np.bincount(starts, minlength=5)
    assert counts.size == 5 and counts.min() > 40, counts  # 80 expected each
    y = make_input("ties", 20_000, tf.float32, 5)
    values, indices = ops.stateless_mstopk(y, 200, [3, 4])
    np.testing.assert_array_equal(values.numpy(), y[indices.numpy()])
    _, _, thresholds = ops._mstopk(tf.constant(y), tf.constant(200, tf.int64), 30, None, tf.int32)
    check_against_reference(y, 200, 30, values.numpy(), indices.numpy(), thresholds.numpy())
    with pytest.raises(ValueError, match=r"seed must have shape \[2\]"):
        ops.stateless_mstopk(x, 3, [1, 2, 3])


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


# scripts/gpu_check.sh sets HVDX_REQUIRE_GPU=1: there, a GPU test that would skip fails.
GPU = tf.config.list_physical_devices("GPU")
needs_gpu = pytest.mark.skipif(not GPU and not os.environ.get("HVDX_REQUIRE_GPU"), reason="no GPU on this machine")


@needs_gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_cuda_kernel_matches_cpu_kernel(dtype):
    assert GPU and ops.build_info()["cuda"], f"no GPU, or a library built without CUDA: {ops.build_info()}"
    cases = [(pattern, d, k, n) for pattern in PATTERNS
             for d, k, n in [(1000, 10, 30), (100_000, 100, 30), (1_000_003, 1000, 30), (5000, 4000, 12),
                             (2_000_001, 20_000, 30), (300_000, 300, 4), (1000, 0, 30), (1000, 1000, 30),
                             (1000, 5000, 30)]]
    for pattern, d, k, n in cases:
        x = make_input(pattern, d, DTYPES[dtype], seed=d)
        with tf.device("/CPU:0"):
            _, cpu_indices, cpu_thresholds = ops._mstopk(tf.constant(x, DTYPES[dtype]), tf.constant(k, tf.int64), n, None, tf.int32)
        with tf.device("/GPU:0"):
            gpu_values, gpu_indices, gpu_thresholds = ops._mstopk(tf.constant(x, DTYPES[dtype]), tf.constant(k, tf.int64), n, None, tf.int32)
        assert "GPU" in gpu_indices.device, gpu_indices.device  # the CUDA kernel ran, not a CPU fallback
        np.testing.assert_array_equal(gpu_thresholds.numpy(), cpu_thresholds.numpy())
        check_against_reference(x, k, n, gpu_values.numpy(), gpu_indices.numpy().astype(np.int64),
                                gpu_thresholds.numpy())


@pytest.mark.parametrize("pattern", HEAVY + ["normal"])
@pytest.mark.parametrize("density,num_samplings", [(0.001, 30), (0.01, 30), (0.001, 5)])
def test_heavy_tails_at_scale_match_algorithm_1(pattern, density, num_samplings):
    """The kernel answers most rounds from short lists of each range's largest elements; on
    heavy tails (and layered, gradient-like data) ranges hold very unequal shares of them,
    thresholds fall below the lists, thres2's tie-break needs more: still the reference's."""
    d = 2_000_003
    x = make_input(pattern, d, tf.float32, seed=d + len(pattern))
    k = int(density * d)
    values, indices, thresholds = run_op(x, k, num_samplings, tf.float32)
    check_against_reference(x, k, num_samplings, values, indices, thresholds)


def test_concentrated_large_elements_and_discrete_values_match_algorithm_1():
    """Every large magnitude in one range of the kernel (a range must collect again), and
    values on a coarse grid (thresholds between grid points: ties in thres2's counts)."""
    d = 1_500_000
    rng = np.random.default_rng(5)
    x = rng.standard_normal(d).astype(np.float32) * 1e-3
    x[700_000:760_000] = rng.standard_normal(60_000) * 10
    for k, n in [(1500, 30), (15_000, 30), (1500, 3)]:
        check_against_reference(x, k, n, *run_op(x, k, n, tf.float32))
    grid = np.round(rng.standard_normal(d) * 4).astype(np.float32)
    for k, n in [(1500, 30), (150_000, 30), (1500, 7)]:
        check_against_reference(grid, k, n, *run_op(grid, k, n, tf.float32))


_THREADS_SCRIPT = """
import sys, numpy as np, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[1]))
import hvdx
from hvdx import ops
from tests.test_mstopk import make_input
tf.random.set_seed(11)
out = []
for pattern in ("normal", "layered", "student_t", "many_nonfinite"):
    x = make_input(pattern, 700_001, tf.float32, seed=3)
    for k in (700, 7000):
        values, indices, thresholds = ops._mstopk(tf.constant(x), tf.constant(k, tf.int64), 30, 5, tf.int32)
        out.append(np.concatenate([thresholds.numpy().view(np.int64), indices.numpy().astype(np.int64)]))
np.save(sys.argv[2], np.concatenate(out))
"""


def test_same_selection_on_any_number_of_threads(tmp_path):
    """Counts are integers and lists are per range of x: 1 thread or 3 give the same bits."""
    from tests import harness

    results, procs = [], {}
    for threads in (1, 3):  # a fresh interpreter each (the thread pool is set before TensorFlow starts), both at once
        procs[threads] = subprocess.Popen([sys.executable, "-c", _THREADS_SCRIPT, str(threads),
                                           str(tmp_path / f"threads{threads}.npy")], cwd=str(harness.ROOT),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=harness.test_env(str(tmp_path)))
    try:
        for threads, proc in procs.items():
            _, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-3000:]
            results.append(np.load(tmp_path / f"threads{threads}.npy"))
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("pattern", ["normal", "layered", "ties"])
def test_forced_int64_indices_select_what_int32_does(pattern):
    """index_dtype=tf.int64 on a small d: the same selection as int32 (wire format of buckets
    of 2^31 elements or more, tested where it fits in memory)."""
    x = make_input(pattern, 300_007, tf.float32, seed=9)
    selections = []
    for index_dtype in (tf.int32, tf.int64):
        tf.random.set_seed(1234)
        values, indices = hvdx.mstopk(x, 3000, seed=4321, index_dtype=index_dtype)
        assert indices.dtype == index_dtype
        np.testing.assert_array_equal(values.numpy(), x[indices.numpy()])
        selections.append(indices.numpy().astype(np.int64))
    np.testing.assert_array_equal(selections[0], selections[1])
    _, _, thresholds = ops._mstopk(tf.constant(x), tf.constant(3000, tf.int64), 30, None, tf.int64)
    check_against_reference(x, 3000, 30, *(t.numpy() for t in hvdx.mstopk(x, 3000, index_dtype=tf.int64)),
                            thresholds.numpy())
    with pytest.raises(ValueError, match="index_dtype"):
        hvdx.mstopk(x, 10, index_dtype=tf.int16)


@needs_gpu
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64], ids=lambda d: d.name)
def test_cuda_kernel_heavy_tails_at_scale(index_dtype):
    """The CPU kernel's lists and fallbacks against the GPU's round-by-round passes."""
    assert GPU, "HVDX_REQUIRE_GPU=1 but TensorFlow sees no GPU"
    for pattern in HEAVY + ["normal", "nonfinite", "ties"]:
        x = make_input(pattern, 3_000_017, tf.float32, seed=17)
        for k in (3000, 30_000):
            with tf.device("/CPU:0"):
                _, _, cpu_thresholds = ops._mstopk(tf.constant(x), tf.constant(k, tf.int64), 30, None, index_dtype)
            with tf.device("/GPU:0"):
                values, indices, thresholds = ops._mstopk(tf.constant(x), tf.constant(k, tf.int64), 30, None,
                                                          index_dtype)
            assert indices.dtype == index_dtype
            np.testing.assert_array_equal(thresholds.numpy(), cpu_thresholds.numpy())
            check_against_reference(x, k, 30, values.numpy(), indices.numpy().astype(np.int64), thresholds.numpy())
