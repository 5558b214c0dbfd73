"""hvdx.variables.slot_variables: the optimizer's state of one model variable, whatever the
Keras optimizer kind (PASSM+ zeroes it for the layers a process did not update)."""
import numpy as np
import pytest
import tensorflow as tf

import hvdx  # noqa: F401
from hvdx.variables import slot_variables

OPTIMIZERS = {
    "sgd_momentum": (lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9), 1),
    "adam": (lambda: tf.keras.optimizers.Adam(0.01), 2),
    "legacy_sgd_momentum": (lambda: tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9), 1),  # Keras 2's
    "loss_scale_adam": (lambda: tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(0.01)), 2),
}


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=[pytest.mark.keras2] if kind.startswith("legacy") else [])
                                  for kind in sorted(OPTIMIZERS)])
def test_slot_variables_are_the_optimizers_state_of_that_variable_only(kind):
    make, count = OPTIMIZERS[kind]
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,)), tf.keras.layers.Dense(2)])
    opt = make()
    assert all(slot_variables(opt, v) == [] for v in model.trainable_variables)  # not built yet
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones([2, 4])))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    seen = set()
    for v in model.trainable_variables:
        slots = slot_variables(opt, v)
        assert len(slots) == count, (kind, v.name, [s.name for s in slots])
        assert all(tuple(s.shape) == tuple(v.shape) and np.any(s.numpy() != 0) for s in slots)
        assert not any(s is v for s in slots)
        seen.update(id(s) for s in slots)
    assert len(seen) == count * len(model.trainable_variables)  # no slot shared between variables
    slots = slot_variables(opt, model.trainable_variables[0])
    for s in slots:
        s.assign(tf.zeros(s.shape, s.dtype))
    assert all(np.any(s.numpy() != 0) for s in slot_variables(opt, model.trainable_variables[1]))


def test_a_variable_the_optimizer_does_not_update_has_no_slots():
    opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    used, other = tf.Variable(tf.ones([3])), tf.Variable(tf.ones([3]))
    opt.apply_gradients([(tf.ones([3]), used)])
    assert len(slot_variables(opt, used)) == 1 and slot_variables(opt, other) == []
