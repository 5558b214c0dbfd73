"""sparse_accumulate adds sparse entries into a dense vector, like np.add.at."""
import os

import numpy as np
import pytest
import tensorflow as tf

import hvdx

DTYPES = [tf.float32, tf.float16, tf.bfloat16]


def reference(values, indices, size, out=None):
    acc = np.zeros(size, np.float64) if out is None else np.asarray(out, np.float64).copy()
    np.add.at(acc, indices, np.asarray(values, np.float64))
    return acc


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64], ids=lambda d: d.name)
@pytest.mark.parametrize("size,nnz", [(1, 0), (1, 5), (10, 30), (100_000, 5_000)])
def test_matches_np_add_at(dtype, index_dtype, size, nnz):
    rng = np.random.default_rng(size + nnz)
    values = rng.integers(-8, 8, nnz).astype(np.float32)  # exact in every dtype
    indices = rng.integers(0, size, nnz)
    got = hvdx.sparse_accumulate(tf.constant(values, dtype), tf.constant(indices, index_dtype), size)
    assert got.dtype == dtype and got.shape == (size,)
    np.testing.assert_array_equal(got.numpy().astype(np.float64), reference(values, indices, size))


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda d: d.name)
def test_adds_onto_out_and_accumulates_16_bit_in_float32(out_dtype):
    # 2048 + 1 + 1 + ... in float16 would stay at 2048 if rounded after every add.
    size, nnz = 8, 1024
    values = tf.ones([nnz], tf.float16)
    indices = tf.zeros([nnz], tf.int32)
    out = tf.constant([2048.0] + [1.0] * (size - 1), out_dtype)
    got = hvdx.sparse_accumulate(values, indices, size, out=out)
    assert got.dtype == out_dtype
    np.testing.assert_allclose(got.numpy().astype(np.float64), [2048.0 + nnz] + [1.0] * (size - 1),
                               rtol=2 ** -7)
    np.testing.assert_array_equal(out.numpy()[0], 2048.0)  # the input is not modified


def test_out_of_range_and_mismatched_lengths_raise():
    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
        hvdx.sparse_accumulate(tf.ones([2]), tf.constant([0, 4]), 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
        hvdx.sparse_accumulate(tf.ones([1]), tf.constant([-1]), 4)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        hvdx.sparse_accumulate(tf.ones([2]), tf.constant([0, 1, 2]), 4)


def test_bad_types_and_sizes_raise_value_error():
    with pytest.raises(ValueError, match="values must be"):
        hvdx.sparse_accumulate(tf.ones([2], tf.int32), tf.constant([0, 1]), 4)
    with pytest.raises(ValueError, match="indices must be"):
        hvdx.sparse_accumulate(tf.ones([2]), tf.constant([0.0, 1.0]), 4)
    with pytest.raises(ValueError, match="size=5 but out has 4"):
        hvdx.sparse_accumulate(tf.ones([2]), tf.constant([0, 1]), 5, out=tf.zeros([4]))


def test_works_inside_tf_function():
    @tf.function(jit_compile=False)
    def f(values, indices):
        return hvdx.sparse_accumulate(values, indices, 6)

    got = f(tf.constant([1.0, 2.0, 3.0]), tf.constant([5, 0, 5]))
    np.testing.assert_array_equal(got.numpy(), [2, 0, 0, 0, 0, 4])


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=80, deadline=None)
@given(size=st.one_of(st.integers(1, 100), st.integers(101, 10**6)), nnz=st.integers(0, 3000),
       dtype=st.sampled_from(DTYPES), index_dtype=st.sampled_from([tf.int32, tf.int64]),
       with_out=st.booleans(), seed=st.integers(0, 2**31))
def test_property_matches_np_add_at(size, nnz, dtype, index_dtype, with_out, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(-4, 5, nnz).astype(np.float32)  # exact sums in every dtype
    indices = rng.integers(0, min(size, 50) if seed % 2 else size, nnz)  # many duplicates, or few
    out = rng.integers(-4, 5, size).astype(np.float32) if with_out else None
    got = hvdx.sparse_accumulate(tf.constant(values, dtype), tf.constant(indices, index_dtype), size,
                                 out=None if out is None else tf.constant(out, dtype))
    expected = reference(values, indices, size, out)
    if dtype != tf.float32:  # float32 sums, one rounding to the 16-bit result
        expected = tf.constant(expected, tf.float32).numpy().astype(dtype.as_numpy_dtype)
    np.testing.assert_array_equal(got.numpy().astype(np.float64), np.asarray(expected, np.float64))


# -- determinism: the order of the additions is part of the op's contract ---------------------

def ordered_reference(values: np.ndarray, indices: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """The kernels' order, emulated: each element starts from float32(dense[i]) and adds its
    entries one by one in ascending j in float32 (the GPU sorts by index stably and does the
    same), before one rounding to the result's dtype."""
    acc = dense.astype(np.float32).copy()
    v = values.astype(np.float32)
    for j in range(indices.size):
        acc[indices[j]] = np.float32(acc[indices[j]] + v[j])
    return acc


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("size,nnz", [(50, 3000), (100_000, 70_000), (3_000_001, 40_000)])
def test_adds_in_ascending_entry_order_bit_for_bit(dtype, size, nnz):
    """Sums of non-exact floats with many duplicates: exactly the ascending-j float32 order,
    over several shards and entry chunks (the CPU kernel's parallel split)."""
    rng = np.random.default_rng(size)
    values = tf.constant(rng.standard_normal(nnz) * 10.0 ** rng.uniform(-3, 3, nnz), dtype)
    indices = rng.integers(0, min(size, 5000), nnz)  # many duplicates
    dense = tf.constant(rng.standard_normal(size), dtype)
    expected = tf.cast(ordered_reference(values.numpy().astype(np.float32), indices,
                                         dense.numpy().astype(np.float32)), dtype).numpy()
    for index_dtype in (tf.int32, tf.int64):
        got = hvdx.sparse_accumulate(values, tf.constant(indices, index_dtype), size, out=dense)
        np.testing.assert_array_equal(got.numpy().view(np.uint8), expected.view(np.uint8))
        zeros = tf.cast(ordered_reference(values.numpy().astype(np.float32), indices,
                                          np.zeros(size, np.float32)), dtype).numpy()
        got = hvdx.sparse_accumulate(values, tf.constant(indices, index_dtype), size)
        np.testing.assert_array_equal(got.numpy().view(np.uint8), zeros.view(np.uint8))


def test_repeated_runs_are_bitwise_equal():
    rng = np.random.default_rng(3)
    values = tf.constant(rng.standard_normal(200_000), tf.float32)
    indices = tf.constant(rng.integers(0, 1000, 200_000), tf.int32)
    first = hvdx.sparse_accumulate(values, indices, 1_000_000).numpy()
    for _ in range(3):
        np.testing.assert_array_equal(hvdx.sparse_accumulate(values, indices, 1_000_000).numpy().view(np.uint32),
                                      first.view(np.uint32))


# scripts/gpu_check.sh sets HVDX_REQUIRE_GPU=1: there, a GPU test that would skip fails.
GPU = tf.config.list_physical_devices("GPU")
needs_gpu = pytest.mark.skipif(not GPU and not os.environ.get("HVDX_REQUIRE_GPU"), reason="no GPU on this machine")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64], ids=lambda d: d.name)
def test_cuda_kernel_equals_cpu_kernel_bit_for_bit(dtype, index_dtype):
    """Every rank accumulates the same gathered pairs: the GPU's sum must not depend on the
    run (no atomics) and must equal the CPU's, so replicas never drift apart."""
    assert GPU and hvdx.ops.build_info()["cuda"], f"no GPU, or a library built without CUDA: {hvdx.ops.build_info()}"
    rng = np.random.default_rng(7)
    for size, nnz, spread in [(1, 0, 1), (10, 30, 10), (1_000_000, 200_000, 2000), (4_000_000, 500_000, 4_000_000)]:
        values = tf.constant(rng.standard_normal(nnz) * 10.0 ** rng.uniform(-3, 3, nnz), dtype)
        indices = tf.constant(rng.integers(0, spread, nnz), index_dtype)
        dense = tf.constant(rng.standard_normal(size), dtype)
        with tf.device("/CPU:0"):
            cpu = hvdx.sparse_accumulate(values, indices, size, out=dense).numpy()
            cpu_zeros = hvdx.sparse_accumulate(values, indices, size).numpy()
        with tf.device("/GPU:0"):
            on_gpu = hvdx.sparse_accumulate(values, indices, size, out=dense)
            assert "GPU" in on_gpu.device, on_gpu.device  # the CUDA kernel ran, not a CPU fallback
            runs = [hvdx.sparse_accumulate(values, indices, size, out=dense).numpy() for _ in range(3)]
            runs_zeros = [hvdx.sparse_accumulate(values, indices, size).numpy() for _ in range(3)]
        for got in runs:
            np.testing.assert_array_equal(got.view(np.uint8), cpu.view(np.uint8))
        for got in runs_zeros:
            np.testing.assert_array_equal(got.view(np.uint8), cpu_zeros.view(np.uint8))


@needs_gpu
def test_cuda_kernel_ignores_out_of_range_indices():
    assert GPU, "HVDX_REQUIRE_GPU=1 but TensorFlow sees no GPU"
    with tf.device("/GPU:0"):
        got = hvdx.sparse_accumulate(tf.ones([4]), tf.constant([0, -1, 4, 2]), 4).numpy()
    np.testing.assert_array_equal(got, [1, 0, 1, 0])


def test_gradients_are_those_of_a_linear_scatter():
    values = tf.Variable([1.0, 2.0, 3.0])
    dense = tf.Variable([10.0, 20.0, 30.0, 40.0])
    indices = tf.constant([3, 0, 3])
    weights = tf.constant([1.0, 2.0, 3.0, 4.0])
    with tf.GradientTape(persistent=True) as tape:
        accumulated = tf.reduce_sum(weights * hvdx.sparse_accumulate(values, indices, 4, out=dense))
        scattered = tf.reduce_sum(weights * hvdx.sparse_accumulate(values, indices, 4))
    np.testing.assert_array_equal(tape.gradient(accumulated, values).numpy(), [4.0, 1.0, 4.0])
    np.testing.assert_array_equal(tape.gradient(accumulated, dense).numpy(), [1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(tape.gradient(scattered, values).numpy(), [4.0, 1.0, 4.0])
    x = tf.Variable(np.arange(10, dtype=np.float32))
    with tf.GradientTape() as tape:
        selected, _ = hvdx.mstopk(x, 3)
        total = tf.reduce_sum(selected)
    assert tape.gradient(total, x) is None  # MSTopK is declared not differentiable
