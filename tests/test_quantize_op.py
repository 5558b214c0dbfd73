"""hvdx.ops.quantize / dequantize: the wire's chunked low-bit codes (hvdx/comm/wire.py) in one
pass, the same bytes as a NumPy reference and as TensorFlow's element-wise form."""
import numpy as np
import pytest
import tensorflow as tf

from hvdx import ops
from hvdx.comm import wire


def reference(x: np.ndarray, bits: int, chunk: int):
    """(packed bytes, values) in float32 NumPy: s = max|x| / L, q = clip(round_half_even(x / s))."""
    level = np.float32(2 ** (bits - 1) - 1)
    rows = x.reshape(-1, chunk)
    scale = (np.abs(rows).max(axis=1) / level).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[:, None] == 0, np.float32(0), np.round(rows / scale[:, None]))
    q = np.clip(q, -level, level).astype(np.float32)
    if bits == 8:
        codes = q.reshape(-1).astype(np.int8).view(np.uint8)
    else:
        nibbles = (q.reshape(-1, 2) + 8).astype(np.uint8)
        codes = (nibbles[:, 0] * 16 + nibbles[:, 1]).astype(np.uint8)
    return np.concatenate([codes, scale.view(np.uint8)]), (q * scale[:, None]).reshape(-1)


def values(rng, n):
    """Magnitudes over six decades, a zero chunk's worth of zeros, and exact halves of a step."""
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3], n)).astype(np.float32)
    x[: n // 4] = 0.0
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("chunk,chunks", [(2, 5), (6, 3), (1024, 9), (3000, 4)])  # 3000: blocks of 1024 and a rest
def test_equals_the_numpy_reference_bit_for_bit(bits, chunk, chunks):
    x = values(np.random.default_rng(bits * chunk), chunk * chunks)
    level = 2 ** (bits - 1) - 1
    x[chunk * (chunks - 1):] = np.float32(level) * np.linspace(-1, 1, chunk, dtype=np.float32)  # halves: even
    packed, decoded = ops.quantize(tf.constant(x), bits, chunk)
    want_packed, want_values = reference(x, bits, chunk)
    np.testing.assert_array_equal(packed.numpy(), want_packed)
    np.testing.assert_array_equal(decoded.numpy(), want_values)
    np.testing.assert_array_equal(ops.dequantize(packed, bits, chunk).numpy(), want_values)  # what the receiver gets


@pytest.mark.parametrize("bits", [8, 4])
def test_the_wire_gives_the_same_bytes_with_tensorflows_ops(bits, monkeypatch):
    """The kernel where TensorFlow sees no GPU, TensorFlow's element-wise ops on one: one format."""
    x = tf.constant(values(np.random.default_rng(bits), 64 * 40))
    packed, decoded = wire.quantize(x, bits, 64)
    monkeypatch.setattr(wire, "_one_pass_kernels", lambda: False)
    tf_packed, tf_decoded = wire.quantize(x, bits, 64)
    np.testing.assert_array_equal(packed.numpy(), tf_packed.numpy())
    np.testing.assert_array_equal(decoded.numpy(), tf_decoded.numpy())
    np.testing.assert_array_equal(wire.dequantize(tf_packed, x.shape[0], bits, 64).numpy(), decoded.numpy())


def test_a_non_finite_value_makes_its_chunk_decode_non_finite_and_no_other():
    x = np.ones(4 * 8, np.float32)
    x[3], x[9] = np.nan, np.inf
    for bits in (8, 4):
        packed, decoded = ops.quantize(x, bits, 8)
        for out in (decoded.numpy(), ops.dequantize(packed, bits, 8).numpy()):
            assert np.isnan(out[:16]).all() and np.isfinite(out[16:]).all()
            np.testing.assert_array_equal(out[16:], 1.0)


def test_inside_a_traced_step_shapes_are_static():
    f = tf.function(lambda x: ops.dequantize(ops.quantize(x, 4, 16)[0], 4, 16))
    graph = f.get_concrete_function(tf.TensorSpec([160], tf.float32)).graph
    assert graph.outputs[0].shape == [160]


def test_bad_inputs_raise_naming_the_problem():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        ops.quantize(np.zeros(8, np.float32), 2, 4)
    with pytest.raises(ValueError, match="chunk must be an even int"):
        ops.quantize(np.zeros(9, np.float32), 8, 3)
    with pytest.raises(ValueError, match="multiple of chunk = 4"):
        ops.quantize(np.zeros(6, np.float32), 8, 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="whole number of 12-byte chunks"):
        ops.dequantize(np.zeros(13, np.uint8), 8, 8)
