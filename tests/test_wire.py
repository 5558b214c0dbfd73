"""The sparse strategies' wire format (hvdx.comm.wire): every index type in every wire
type round-trips, and float16 packets carry values beyond float16's range."""
import numpy as np
import pytest
import tensorflow as tf

from hvdx.comm import wire


@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("wire_dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_packets_of_several_senders_round_trip(index_dtype, wire_dtype):
    rng = np.random.default_rng(0)
    k, senders = 7, 3
    values = [rng.standard_normal(k).astype(np.float32) * 100 for _ in range(senders)]
    # int64 indices beyond 2**31, as a bucket of d >= 2**31 elements would select
    big = 2 ** 33 if index_dtype == tf.int64 else 2 ** 30
    indices = [rng.integers(0, big, k) for _ in range(senders)]
    packets = [wire.pack(tf.constant(v), tf.constant(i, index_dtype), wire_dtype) for v, i in zip(values, indices)]
    got_values, got_indices = wire.unpack(tf.concat(packets, 0), k, index_dtype)
    assert got_indices.dtype == index_dtype
    np.testing.assert_array_equal(got_indices.numpy(), np.concatenate(indices))
    sent = np.concatenate([wire.decode_sent(tf.constant(v), wire_dtype).numpy() for v in values])
    np.testing.assert_array_equal(got_values.numpy(), sent)  # receivers decode what senders subtract
    np.testing.assert_allclose(got_values.numpy(), np.concatenate(values), rtol=1e-2 if wire_dtype != tf.float32 else 0)


def test_float16_wire_scales_large_values_and_keeps_inf_nan():
    values = tf.constant([1e5, -3e6, 0.5, np.inf, np.nan], tf.float32)
    got, _ = wire.unpack(wire.pack(values, tf.range(5), tf.float16), 5, tf.int32)
    got = got.numpy()
    assert np.isfinite(got[:3]).all()
    np.testing.assert_allclose(got[:2], [1e5, -3e6], rtol=1e-3)
    assert np.isposinf(got[3]) and np.isnan(got[4])


def test_wire_dtypes_are_checked_in_one_place():
    """The sparse strategies, 2DTAR, the dense allreduce and DASO's blocking average accept
    the same dtypes, by object or name, and reject others naming the argument."""
    for value in (tf.float16, "bfloat16", np.float32):
        assert wire.check_dtype(value) in wire.WIRE_DTYPES
    for bad in ("int8", "float64", "fp8", 3):
        with pytest.raises(ValueError, match="blocking_wire_dtype must be one of"):
            wire.check_dtype(bad, "blocking_wire_dtype")


def test_float16_upscaling_keeps_small_values_out_of_subnormals():
    """With upscale (DASO's changes), values far below float16's normal range (6.1e-5) keep
    float16's 11 significant bits; without it (sparse packets) they are sent as they are."""
    values = tf.constant(np.linspace(-3e-7, 4e-7, 101, dtype=np.float32))
    on_wire, e = wire.to_wire(values, tf.float16, upscale=True)
    decoded = tf.cast(on_wire, tf.float32).numpy() * 2.0 ** e.numpy()
    assert e.numpy() < 0 and np.abs(on_wire.numpy()).max() <= 2 ** 14
    np.testing.assert_allclose(decoded, values.numpy(), rtol=2 ** -11, atol=0)
    plain, e0 = wire.to_wire(values, tf.float16)
    assert e0.numpy() == 0 and np.abs(tf.cast(plain, tf.float32).numpy() - values.numpy()).max() > 1e-9
    zeros, ez = wire.to_wire(tf.zeros([4]), tf.float16, upscale=True)
    assert ez.numpy() == 0 and not np.any(zeros.numpy())
    huge, eh = wire.to_wire(tf.constant([1e30, -2.0, np.inf]), tf.float16, upscale=True)
    assert np.isfinite(eh.numpy()) and np.isinf(huge.numpy()[2]) and np.isfinite(huge.numpy()[:2]).all()
