"""LocalSGD (hvdx/localsgd.py): local steps, then DiLoCo's outer step on the averaged models
(Douillard et al. 2023, arXiv 2311.08105, Algorithm 1; with an outer SGD(1.0), Lin et al.'s
periodic averaging, arXiv 1808.07217). In process on one rank: the outer step's arithmetic,
the counting, the checks, state(), fit through the one callback; on 2x2 Horovod ranks
(tests/multirank/check_localsgd.py): the average over ranks, and fit on the digits.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests import harness, suite


@pytest.fixture(scope="module")
def one_rank():
    import hvdx
    return hvdx.init()


def _sgd_step(var, value):
    """A local step that sets `var` to `value` (what an inner optimizer's update does)."""
    var.assign(np.asarray(value, np.float32))


def test_a_synchronisation_moves_the_anchor_by_the_outer_optimizer_on_the_pseudo_gradient(one_rank):
    import tensorflow as tf

    from hvdx.localsgd import LocalSGD
    var = tf.Variable(np.array([1.0, 2.0, 3.0], np.float32))
    method = LocalSGD(sync_every=2, outer_optimizer=tf.keras.optimizers.SGD(0.5)).start([var])
    _sgd_step(var, [3.0, 2.0, 1.0])
    method.after_step()
    assert method.pending == 1 and method.outer_steps == 0   # not yet: every 2 local steps
    _sgd_step(var, [5.0, 4.0, -1.0])
    method.after_step()
    # one rank: the mean is this rank's model; delta = anchor - mean; anchor <- anchor - 0.5 delta
    np.testing.assert_allclose(var.numpy(), [3.0, 3.0, 1.0])
    np.testing.assert_array_equal(method.anchor[0].numpy(), var.numpy())
    assert (method.steps, method.outer_steps, method.pending) == (2, 1, 0)


def test_the_default_outer_optimizer_is_dilocos_nesterov_momentum(one_rank):
    """DiLoCo sec. 3's outer step where the inner optimizer has no heavy-ball momentum (here
    none is given to start())."""
    import tensorflow as tf

    from hvdx.localsgd import LocalSGD
    method = LocalSGD(sync_every=1)
    assert method.outer_optimizer is None  # chosen at the first start(), from the inner optimizer
    var = tf.Variable(np.zeros(2, np.float32))
    method.start([var])
    config = method.outer_optimizer.get_config()
    assert (config["learning_rate"], config["momentum"], config["nesterov"]) == (pytest.approx(0.7), 0.9, True)
    anchor, velocity = np.zeros(2), np.zeros(2)
    for local in ([1.0, -2.0], [0.5, 0.5], [2.0, 0.0]):
        _sgd_step(var, np.asarray(local) + anchor)        # this round's local progress from the anchor
        method.after_step()
        delta = -np.asarray(local)                       # anchor - x_local (one rank: the mean is x_local)
        velocity = 0.9 * velocity - 0.7 * delta          # Keras' SGD with Nesterov momentum
        anchor = anchor + 0.9 * velocity - 0.7 * delta
        np.testing.assert_allclose(var.numpy(), anchor, rtol=1e-6)


def test_over_an_inner_optimizer_with_momentum_the_default_outer_step_is_the_average(one_rank):
    """Outer Nesterov momentum over inner heavy-ball momentum diverged in hvdx's runs
    (docs/streaming_diloco.md): over SGD or LARS with momentum the default outer optimizer is
    SGD(1.0), Lin et al.'s averaging; over Adam, plain SGD, or none, DiLoCo's."""
    import tensorflow as tf

    from hvdx.localsgd import LocalSGD, default_outer_optimizer
    from hvdx.optimizers import LARS
    from hvdx.streaming_diloco import StreamingDiLoCo

    def outer(inner):
        config = default_outer_optimizer(inner).get_config()
        return float(config["learning_rate"]), float(config["momentum"]), bool(config["nesterov"])

    average, diloco = (1.0, 0.0, False), (pytest.approx(0.7), 0.9, True)
    assert outer(tf.keras.optimizers.SGD(0.1, momentum=0.9)) == average
    assert outer(tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)) == average
    assert outer(LARS(0.1, momentum=0.9)) == average
    assert outer(tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9))) == average
    for inner in (tf.keras.optimizers.SGD(0.1), tf.keras.optimizers.Adam(), tf.keras.optimizers.AdamW(), None):
        assert outer(inner) == diloco, inner
    for cls in (LocalSGD, StreamingDiLoCo):  # what start() takes, the model's optimizer, decides
        method = cls(sync_every=4).start([tf.Variable(np.zeros(2, np.float32)) for _ in range(3)],
                                         tf.keras.optimizers.SGD(0.1, momentum=0.9))
        assert method.outer_optimizer.get_config()["momentum"] == 0.0
        method.close()
    given = tf.keras.optimizers.SGD(0.5, momentum=0.5)  # a given one is kept
    method = LocalSGD(outer_optimizer=given).start([tf.Variable(np.zeros(2, np.float32))],
                                                   tf.keras.optimizers.SGD(0.1, momentum=0.9))
    assert method.outer_optimizer is given


def test_outer_sgd_of_rate_one_is_periodic_model_averaging(one_rank):
    import tensorflow as tf

    from hvdx.localsgd import LocalSGD
    var = tf.Variable(np.zeros(3, np.float32))
    method = LocalSGD(sync_every=3, outer_optimizer=tf.keras.optimizers.SGD(1.0)).start([var])
    for k in range(3):
        _sgd_step(var, [k + 1.0, 2.0 * k, -1.0])
        method.after_step()
    np.testing.assert_allclose(var.numpy(), [3.0, 4.0, -1.0])  # the (one rank's) model: the average itself


def test_epochs_end_synchronised_and_finish_synchronises_once(one_rank):
    import tensorflow as tf

    from hvdx.localsgd import LocalSGD
    var = tf.Variable(np.zeros(1, np.float32))
    method = LocalSGD(sync_every=8, outer_optimizer=tf.keras.optimizers.SGD(1.0)).start([var])
    for _ in range(3):
        var.assign_add([1.0])
        method.after_step()
    method.end_epoch(0, None)
    assert (method.outer_steps, method.pending) == (1, 0)   # the epoch's 3 pending steps: synchronised
    method.end_epoch(1, None)
    assert method.outer_steps == 1                          # nothing pending: no collective
    lazy = LocalSGD(sync_every=8, sync_every_epoch=False).start([tf.Variable(np.zeros(1, np.float32))])
    lazy.after_step()
    lazy.end_epoch(0, None)
    assert (lazy.outer_steps, lazy.pending) == (0, 1)       # counted on across epochs
    lazy.finish()
    lazy.finish()                                           # idempotent
    assert (lazy.outer_steps, lazy.pending) == (1, 0)
    lazy.close()
    lazy.close()
    with pytest.raises(RuntimeError, match="needs start"):
        lazy.after_step()                                   # closed: start() again first
    lazy.start(lazy.variables)
    lazy.reset()
    with pytest.raises(RuntimeError, match="again after reset"):
        lazy.after_step()


def test_bad_arguments_and_synchronous_optimizers_are_refused(one_rank):
    import tensorflow as tf

    import hvdx
    from hvdx.localsgd import LocalSGD
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="sync_every must be a positive number"):
            LocalSGD(sync_every=bad)
    with pytest.raises(ValueError, match="LocalSGD cannot run with the synchronous"):
        LocalSGD(outer_optimizer=hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(1.0)))
    with pytest.raises(ValueError, match="outer_optimizer must be a Keras optimizer"):
        LocalSGD(outer_optimizer="sgd")
    var = tf.Variable(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="LocalSGD cannot run with the synchronous"):
        LocalSGD().start([var], hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))
    with pytest.raises(ValueError, match="float tf.Variables"):
        LocalSGD().start([tf.Variable(np.zeros(2, np.int32))])
    method = LocalSGD().start([var])
    with pytest.raises(ValueError, match="one LocalSGD per model"):
        method.start([tf.Variable(np.zeros(2, np.float32))])


def test_state_round_trips_through_json(one_rank):
    import tensorflow as tf

    from hvdx.localsgd import LocalSGD
    method = LocalSGD(sync_every=2, outer_optimizer=tf.keras.optimizers.SGD(0.3, momentum=0.5))
    var = tf.Variable(np.zeros(2, np.float32))
    method.start([var])
    for _ in range(5):
        var.assign_add([1.0, -1.0])
        method.after_step()
    state = json.loads(json.dumps(method.state()))
    assert (state["steps"], state["outer_steps"], state["sync_every"]) == (5, 2, 2)
    other = LocalSGD(sync_every=7)                           # another configuration: the state's wins
    other.restore(state)
    assert other.state() == state
    other.start([tf.Variable(np.zeros(2, np.float32))], tf.keras.optimizers.SGD(0.1, momentum=0.9))
    assert other.outer_optimizer.get_config()["momentum"] == 0.5  # the state's, not the default's
    assert other.state() == state


def test_fit_through_the_one_callback_trains_and_counts(one_rank):
    import tensorflow as tf

    from hvdx.callbacks import TrainingMethodCallback
    from hvdx.localsgd import LocalSGD
    from hvdx.zoo import mlp
    rng = np.random.default_rng(0)
    x = rng.random((256, 64), np.float32)
    y = (x[:, :10].argmax(1)).astype(np.int64)
    model = mlp(64, (32,), seed=0)
    model.compile(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    method = LocalSGD(sync_every=3)
    driver = TrainingMethodCallback(method)
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[driver])
    assert history.history["loss"][-1] < history.history["loss"][0]
    # 8 steps per epoch: synchronised after steps 3 and 6 and at the epoch's end (2 pending)
    assert driver.stats == {"method": "LocalSGD", "steps": 32, "outer_steps": 12, "pending": 0, "sync_every": 3}
    for v, a in zip(model.trainable_variables, method.anchor):  # fit ends on the anchor
        np.testing.assert_array_equal(v.numpy(), a.numpy())


# -- Keras 3 beside Keras 2 (tf_keras) in this process; a Keras 3 user's job: tests/test_keras3.py ------
keras3 = harness.KERAS3


@keras3
def test_a_keras3_model_trains_in_fit_with_an_outer_optimizer_of_either_keras(one_rank):
    """A Keras 3 model in Keras 3's `fit`, driven by the one callback: the method averages the
    tf.Variables its Keras 3 variables hold; a Keras 3 outer optimizer moves an anchor of
    Keras 3 variables, a Keras 2 one an anchor of tf.Variables; fit ends on the anchor and the
    Keras 3 optimizer's config goes through state()."""
    import keras
    import tensorflow as tf

    from hvdx import legacy_keras
    from hvdx.callbacks import TrainingMethodCallback
    from hvdx.localsgd import LocalSGD
    rng = np.random.default_rng(0)
    x = rng.random((256, 16), np.float32)
    y = (x[:, :4].argmax(1)).astype(np.int64)
    for outer, anchor_kind in ((keras.optimizers.SGD(0.8, momentum=0.5), keras.Variable),
                               (legacy_keras.keras2().optimizers.SGD(0.8, momentum=0.5), tf.Variable)):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        method = LocalSGD(sync_every=3, outer_optimizer=outer)
        driver = TrainingMethodCallback(method)
        history = model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[driver])
        assert history.history["loss"][-1] < history.history["loss"][0]
        assert driver.stats["outer_steps"] == 12 and driver.stats["pending"] == 0
        assert all(isinstance(a, anchor_kind) for a in method.anchor)
        for v, a in zip(model.trainable_variables, method.anchor):  # fit ends on the anchor
            np.testing.assert_array_equal(v.numpy(), np.asarray(a.numpy()))
        state = json.loads(json.dumps(method.state()))
        fresh = LocalSGD(outer_optimizer=type(outer)(0.1))
        fresh.restore(state)
        assert type(fresh.outer_optimizer) is type(outer) and fresh.outer_optimizer.get_config()["momentum"] == 0.5


@keras3
def test_a_keras3_model_that_runs_several_steps_per_call_is_refused(one_rank):
    import keras

    from hvdx.callbacks import TrainingMethodCallback
    from hvdx.localsgd import LocalSGD
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(np.zeros((8, 4), np.float32), np.zeros((8, 2), np.float32), verbose=0,
                  callbacks=[TrainingMethodCallback(LocalSGD())])


@keras3
def test_the_outer_optimizer_may_be_of_either_keras_and_nothing_else(one_rank):
    import keras

    from hvdx import legacy_keras
    from hvdx.localsgd import check_outer_optimizer
    keras2 = legacy_keras.keras2()
    for optimizer in (keras.optimizers.SGD(0.7), keras2.optimizers.SGD(0.7), keras2.optimizers.legacy.SGD(0.7)):
        assert check_outer_optimizer(optimizer) is optimizer
    for bad in ("sgd", keras.layers.Dense(2), None):
        with pytest.raises(ValueError, match=r"outer_optimizer must be a Keras optimizer \(e.g. keras.optimizers.SGD"):
            check_outer_optimizer(bad)


# -- on Horovod ranks (tests/multirank/check_localsgd.py) ----------------------------------------------
@suite.runs(suite.check("localsgd.averaging", "2x2"))
def test_a_synchronisation_with_outer_rate_one_averages_the_ranks_models(ranks):
    n = ranks[0]["size"]
    for rank, data in ranks.items():
        assert data["started"] == [10.0] * 6, (rank, data)    # start(): rank 0's values everywhere
        mean = sum(r + 1 for r in range(n)) / n
        np.testing.assert_allclose(data["averaged"], np.arange(6) * mean, rtol=1e-6)


@suite.runs(suite.check("localsgd.fit", "2x2", timeout=400))
def test_fit_on_the_digits_trains_and_every_rank_ends_with_the_same_model(ranks):
    accuracy = {rank: data["accuracy"] for rank, data in ranks.items()}
    print("digits test accuracy:", accuracy)
    for rank, data in ranks.items():
        assert data["spread"] == 0.0, (rank, data)             # one model on every rank, bit for bit
        assert data["accuracy"] > 0.8, (rank, data)             # chance is 0.1
        steps = data["steps_per_epoch"] * data["epochs"]
        assert data["stats"]["steps"] == steps and data["stats"]["pending"] == 0, (rank, data)
        # every 8 steps, and each epoch's remainder at its end
        per_epoch = -(-data["steps_per_epoch"] // 8)
        assert data["stats"]["outer_steps"] == per_epoch * data["epochs"], (rank, data)
