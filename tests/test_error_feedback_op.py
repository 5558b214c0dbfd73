"""hvdx.ops.error_feedback: error feedback with DGC's momentum correction in one pass, as
dgc.accumulate specifies it (u' = m u + g, acc = beta v + u'), rounded as written."""
import numpy as np
import pytest
import tensorflow as tf

from hvdx import ops
from hvdx.comm import dgc
from scripts.gpu_harness.checks import error_feedback_reference as reference


def arrays(rng, n, count):
    make = lambda: rng.standard_normal(n).astype(np.float32)  # noqa: E731
    return [make() for _ in range(count)], make(), make()


@pytest.mark.parametrize("n", [0, 1, 1000, 3_000_001])  # 3M: many blocks on every thread
@pytest.mark.parametrize("count", [1, 2, 3, 8])
@pytest.mark.parametrize("momentum,decay", [(0.0, 1.0), (0.9, 1.0), (0.9, 0.5), (0.0, 0.75)])
def test_equals_the_float32_reference_bit_for_bit(n, count, momentum, decay):
    rng = np.random.default_rng(n + count)
    grads, residual, velocity = arrays(rng, n, count)
    corrected = momentum != 0.0
    acc, out = ops.error_feedback([tf.constant(g) for g in grads], tf.constant(residual),
                                  tf.constant(velocity) if corrected else None, momentum=momentum, decay=decay)
    want_acc, want_u = reference(grads, residual, velocity if corrected else None, momentum, decay)
    np.testing.assert_array_equal(acc.numpy(), want_acc)
    if corrected:
        np.testing.assert_array_equal(out.numpy(), want_u)
    else:
        assert out is None


def test_more_than_eight_gradients_are_summed_in_groups():
    rng = np.random.default_rng(7)
    grads, residual, velocity = arrays(rng, 5000, 11)
    acc, u = ops.error_feedback([tf.constant(g) for g in grads], residual, velocity, momentum=0.5)
    g = np.sum(np.stack(grads).astype(np.float64), axis=0)
    np.testing.assert_allclose(u.numpy(), 0.5 * velocity + g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(acc.numpy(), residual + 0.5 * velocity + g, rtol=1e-5, atol=1e-5)


def test_inputs_are_not_modified_and_outputs_are_new_in_a_traced_step():
    """The op may reuse grads[0]'s and the velocity's buffers only when nothing else holds
    them: here the step reads both again after it."""
    rng = np.random.default_rng(3)
    (g0, g1), residual, velocity = arrays(rng, 100_000, 2)

    @tf.function
    def step(a, b, r, u):
        a2, u2 = a * 1.0, u * 1.0  # tensors of the step's own, which later ops read again
        acc, out = ops.error_feedback([a2, b], r, u2, momentum=0.9)
        return acc, out, a2, u2

    acc, out, a2, u2 = step(g0, g1, residual, velocity)
    np.testing.assert_array_equal(a2.numpy(), g0)
    np.testing.assert_array_equal(u2.numpy(), velocity)
    want_acc, want_u = reference([g0, g1], residual, velocity, 0.9, 1.0)
    np.testing.assert_array_equal(acc.numpy(), want_acc)
    np.testing.assert_array_equal(out.numpy(), want_u)


def test_non_finite_entries_propagate():
    g = np.array([1.0, np.inf, np.nan, 2.0], np.float32)
    acc, u = ops.error_feedback([g], np.zeros(4, np.float32), np.ones(4, np.float32), momentum=0.9)
    assert np.isfinite(acc.numpy()).tolist() == [True, False, False, True]
    assert np.isfinite(u.numpy()).tolist() == [True, False, False, True]


def test_bad_inputs_raise_naming_the_problem():
    one = tf.ones([4])
    with pytest.raises(ValueError, match="at least one gradient"):
        ops.error_feedback([], one)
    with pytest.raises(ValueError, match="float32"):
        ops.error_feedback([tf.ones([4], tf.float16)], one)
    with pytest.raises(ValueError, match="one length"):
        ops.error_feedback([tf.ones([5])], one)
    with pytest.raises(ValueError, match="one length"):
        ops.error_feedback([one], one, tf.ones([3]), momentum=0.9)

    @tf.function(input_signature=[tf.TensorSpec([None]), tf.TensorSpec([None])])
    def unknown(g, r):
        return ops.error_feedback([g], r)[0]

    with pytest.raises(tf.errors.InvalidArgumentError, match="must be equal"):
        unknown(tf.ones([5]), one)


def test_accumulate_is_the_op_and_masking_keeps_the_entries_sent_whole():
    rng = np.random.default_rng(5)
    (g,), v, u = arrays(rng, 64, 1)
    acc, vel = dgc.accumulate([tf.constant(g)], tf.constant(v), tf.constant(u), 0.9, 1.0)
    want_acc, want_u = reference([g], v, u, 0.9, 1.0)
    np.testing.assert_array_equal(acc.numpy(), want_acc)
    np.testing.assert_array_equal(vel.numpy(), want_u)
    masked = dgc.mask_velocity(tf.constant(u), tf.constant([3, 10, 40, 63], tf.int32), keep=[10, 11, 63]).numpy()
    want = u.copy()
    want[[3, 40]] = 0
    np.testing.assert_array_equal(masked, want)
