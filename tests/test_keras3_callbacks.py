"""Horovod's Keras callbacks for Keras 3 models (hvdx/keras/keras3_callbacks.py), on the
default stack where `import keras` is Keras 3 beside tf.keras's tf_keras.

On one rank: the broadcast sends the model's and the optimizer's variables (built first),
never hvdx's residuals, once before the first step; the metric average keeps the logs and
refuses ranks with different keys; the warm-up and the schedule set the rate Horovod's
formulas give at each batch; momentum correction scales SGD's velocity by the rate's ratio
at a change, making Horovod's update; the checkpoint keeps the best epoch by Keras 3's file
rules; every callback together trains the digits. On 2 nodes x 2 ranks
(tests/multirank/check_keras3_callbacks.py) the ranks end identical with equal averaged
metrics. Skipped where Keras 3 is absent (the tf2.15 stack)."""
import types

import numpy as np
import pytest
import tensorflow as tf

import hvdx
from tests import suite
from tests import harness
from tests.harness import HAS_KERAS3

pytestmark = harness.KERAS3

if HAS_KERAS3:
    import horovod._keras.callbacks as horovod_impl
    import keras

    from hvdx.keras import keras3_callbacks as k3cb

STEPS = 4  # batches per epoch of `data()` at batch 16


from tests.test_keras3_optimizer import data, one_rank  # noqa: E402,F401  (the same one rank and data)


def model_with(optimizer, built: bool = True):
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    model = keras.Sequential(([keras.Input((8,))] if built else []) + layers)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def fit(model, callbacks, epochs: int = 2, **kwargs):
    x, y = data()
    return model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks, **kwargs)


class RateLog(keras.callbacks.Callback if HAS_KERAS3 else object):
    """The rate each batch starts with (placed after the callback that sets it)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate.numpy()))


def horovods_warmup(epoch: float, size: int, warmup_epochs: int, steps: int) -> float:
    """Horovod 0.28.1's warm-up multiplier (horovod/_keras/callbacks.py), written out."""
    epoch += 1.0 / steps
    return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)


# -- broadcast ----------------------------------------------------------------------------
def test_the_broadcast_sends_model_and_built_optimizer_variables_without_residuals_once(one_rank, monkeypatch):
    calls = []

    def fake_broadcast(variables, root_rank=0, process_set=None):
        calls.append({"variables": list(variables), "root": root_rank, "step": int(opt.iterations.numpy())})

    monkeypatch.setattr(k3cb, "broadcast_variables", fake_broadcast)
    opt = hvdx.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), communication="hitopk", density=1.0)
    model = model_with(opt)
    callback = k3cb.BroadcastGlobalVariablesCallback(root_rank=0)
    fit(model, [callback])
    assert opt.aggregator.residuals, "hitopk keeps residuals: the test must see them left out"
    assert len(calls) == 1 and calls[0]["root"] == 0 and calls[0]["step"] == 0  # before the first step
    sent = [id(v) for v in calls[0]["variables"]]
    want = [id(v) for v in model.variables + opt.inner_optimizer.variables]
    assert sent == want and len(opt.inner_optimizer.momentums) == 2 * 2  # SGD's velocities were built and sent
    residuals = {id(r) for r in opt.aggregator.residuals}
    assert not residuals & {id(hvdx.variables.tf_variable(v)) for v in calls[0]["variables"]}
    fit(model, [callback])
    assert len(calls) == 1 and callback.broadcast_done  # a second fit does not broadcast again


def test_an_unbuilt_model_is_broadcast_after_the_first_batch_and_local_variables_stay(one_rank, monkeypatch):
    calls = []
    monkeypatch.setattr(k3cb, "broadcast_variables",
                        lambda variables, root_rank=0: calls.append((list(variables), int(opt.iterations.numpy()))))
    opt = keras.optimizers.SGD(0.1)
    model = model_with(opt, built=False)  # its variables appear in the first step
    fit(model, [k3cb.BroadcastGlobalVariablesCallback(0)], epochs=1)
    assert len(calls) == 1 and calls[0][1] == 1  # at the end of the first batch (Horovod's timing)
    assert [id(v) for v in calls[0][0]] == [id(v) for v in model.variables + opt.variables]
    local = model.layers[-1].bias
    fit(model, [k3cb.BroadcastGlobalVariablesCallback(0, local_variables=[local])], epochs=1)
    assert len(calls) == 2 and [id(v) for v in calls[1][0]] == [
        id(v) for v in model.variables + opt.variables if v is not local]


def test_the_real_broadcast_runs_on_one_rank_and_keeps_the_weights(one_rank):
    model = model_with(hvdx.DistributedOptimizer(keras.optimizers.SGD(0.0)))
    before = [w.copy() for w in model.get_weights()]
    fit(model, [k3cb.BroadcastGlobalVariablesCallback(0)], epochs=1)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)  # rate 0: only the broadcast (from itself) could move them


# -- metric average -----------------------------------------------------------------------
def test_the_metric_average_on_one_rank_keeps_the_logs(one_rank):
    logs = {"loss": 0.25, "val_accuracy": np.float32(0.75), "count": np.int64(3), "note": "text"}
    k3cb.MetricAverageCallback().on_epoch_end(0, logs)
    assert logs == {"loss": 0.25, "val_accuracy": 0.75, "count": 3.0, "note": "text"}
    assert all(type(logs[k]) is float for k in ("loss", "val_accuracy", "count"))


def test_the_metric_average_refuses_ranks_with_other_metrics(one_rank, monkeypatch):
    fake = types.SimpleNamespace(rank=lambda: 0, allgather_object=lambda obj, name=None: [
        obj, (1, {"metrics": "accuracy, loss, val_loss"})])
    monkeypatch.setattr(k3cb, "hvd", fake)
    with pytest.raises(hvdx.agreement.RankMismatchError, match=r"rank 1: metrics=accuracy, loss, val_loss"):
        k3cb.MetricAverageCallback().on_epoch_end(3, {"loss": 1.0, "accuracy": 0.5})


# -- learning rate --------------------------------------------------------------------------
def test_the_warmup_factor_is_horovods(one_rank):
    impl = horovod_impl.LearningRateWarmupCallbackImpl(None, initial_lr=0.4, warmup_epochs=3)
    impl.steps_per_epoch = 7
    for epoch in (0.0, 1 / 7, 1.5, 2 + 6 / 7):  # Horovod's own, at this job's size (1)
        assert k3cb.warmup_multiplier(epoch, 1, 3, 7) == impl.multiplier(epoch)
    for size in (2, 4, 8):
        for epoch in (0.0, 0.5, 1.25, 2 + 6 / 7):
            assert k3cb.warmup_multiplier(epoch, size, 3, 7) == pytest.approx(horovods_warmup(epoch, size, 3, 7))
        assert k3cb.warmup_multiplier(2 + 6 / 7, size, 3, 7) == pytest.approx(1.0)  # initial_lr at the last batch


def test_the_warmup_sets_horovods_rate_before_every_batch(one_rank, monkeypatch):
    monkeypatch.setattr(k3cb, "hvd", types.SimpleNamespace(size=lambda: 4, rank=lambda: 0))  # as if on 4 ranks
    model = model_with(hvdx.DistributedOptimizer(keras.optimizers.SGD(0.4, momentum=0.9)))
    log = RateLog()
    history = fit(model, [k3cb.LearningRateWarmupCallback(0.4, warmup_epochs=2), log], epochs=3)
    want = [0.4 * horovods_warmup(e + b / STEPS, 4, 2, STEPS) for e in range(2) for b in range(STEPS)] + [0.4] * STEPS
    np.testing.assert_allclose(log.rates, want, rtol=1e-6)
    assert want[0] == pytest.approx(0.4 / 4 * (1 + 3 / 8)) and history.history["lr"][1] == pytest.approx(0.4)


@pytest.mark.parametrize("staircase", [True, False])
def test_the_schedule_sets_the_rate_by_epoch_or_by_batch(one_rank, staircase):
    model = model_with(keras.optimizers.SGD(0.2))
    log = RateLog()
    schedule = k3cb.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1, end_epoch=3, staircase=staircase)
    fit(model, [schedule, log], epochs=4)
    at = (lambda e, b: e) if staircase else (lambda e, b: e + b / STEPS)  # the epoch the multiplier is given
    last = 0.2 * 0.5 ** (at(2, STEPS - 1) - 1)  # after end_epoch the last rate set stays
    want = [0.2 if e < 1 else 0.2 * 0.5 ** (at(e, b) - 1) if e < 3 else last for e in range(4) for b in range(STEPS)]
    np.testing.assert_allclose(log.rates, want, rtol=1e-6)
    assert len(set(log.rates[STEPS:2 * STEPS])) == (1 if staircase else STEPS)


def test_a_learning_rate_schedule_is_refused(one_rank):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    model = model_with(hvdx.DistributedOptimizer(keras.optimizers.SGD(schedule)))
    with pytest.raises(ValueError, match="needs a float learning rate"):
        fit(model, [k3cb.LearningRateWarmupCallback(0.1, warmup_epochs=1)], epochs=1)


def drive(callback, model, epoch: int, batch: int):
    """The callback's hooks as fit calls them before batch `batch` of `epoch`."""
    callback.set_model(model)
    callback.set_params({"epochs": 4, "steps": STEPS})
    callback.on_train_begin()
    callback.on_epoch_begin(epoch)
    callback.on_train_batch_begin(batch)


def built_sgd_model(optimizer):
    model = model_with(optimizer)
    optimizer.build(model.trainable_variables)
    sgd = getattr(optimizer, "inner_optimizer", optimizer)
    rng = np.random.default_rng(2)
    for v in sgd.momentums:
        v.assign(rng.standard_normal(v.shape).astype(np.float32))
    return model, sgd


@pytest.mark.parametrize("wrapped", [False, True])
def test_momentum_correction_scales_the_velocity_at_a_change_into_horovods_update(one_rank, wrapped):
    inner = keras.optimizers.SGD(0.2, momentum=0.9)
    optimizer = hvdx.DistributedOptimizer(inner) if wrapped else inner
    model, sgd = built_sgd_model(optimizer)
    velocity = [v.numpy().copy() for v in sgd.momentums]
    schedule = k3cb.LearningRateScheduleCallback(0.2, 0.5)
    drive(schedule, model, epoch=1, batch=0)  # 0.2 -> 0.1: ratio 0.5
    for got, was in zip(sgd.momentums, velocity):
        np.testing.assert_allclose(got.numpy(), 0.5 * was, rtol=1e-6)
    weights = [w.numpy().copy() for w in model.trainable_variables]
    grads = [np.full(w.shape, 0.3, np.float32) for w in weights]
    optimizer.apply([tf.constant(g) for g in grads], model.trainable_variables)
    for w, was, v, g in zip(model.trainable_variables, weights, velocity, grads):  # Horovod: m' = m * r for one step
        np.testing.assert_allclose(w.numpy(), was + (0.9 * 0.5) * v - 0.1 * g, rtol=1e-5, atol=1e-6)
    velocity = [v.numpy().copy() for v in sgd.momentums]
    schedule.on_train_batch_begin(1)  # staircase: no change within the epoch
    for got, was in zip(sgd.momentums, velocity):
        np.testing.assert_array_equal(got.numpy(), was)


def test_no_velocity_is_scaled_without_correction_or_under_hvdxs_momentum_correction(one_rank):
    model, sgd = built_sgd_model(keras.optimizers.SGD(0.2, momentum=0.9))
    velocity = [v.numpy().copy() for v in sgd.momentums]
    drive(k3cb.LearningRateScheduleCallback(0.2, 0.5, momentum_correction=False), model, 1, 0)
    assert float(sgd.learning_rate.numpy()) == pytest.approx(0.1)
    for got, was in zip(sgd.momentums, velocity):
        np.testing.assert_array_equal(got.numpy(), was)
    optimizer = hvdx.DistributedOptimizer(keras.optimizers.SGD(0.2, momentum=0.9), communication="hitopk",
                                          density=1.0, momentum_correction=True)
    model, sgd = built_sgd_model(optimizer)
    velocity = [v.numpy().copy() for v in sgd.momentums]
    drive(k3cb.LearningRateScheduleCallback(0.2, 0.5), model, 1, 0)
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.1)
    for got, was in zip(sgd.momentums, velocity):
        np.testing.assert_array_equal(got.numpy(), was)


# -- best model -------------------------------------------------------------------------------
def test_the_best_model_checkpoint_keeps_the_best_epoch_by_keras3s_file_rules(one_rank, tmp_path):
    with pytest.raises(ValueError, match=r"\.weights\.h5"):
        k3cb.BestModelCheckpoint(save_weights_only=True, filepath=str(tmp_path / "best.keras"))
    later = k3cb.BestModelCheckpoint()
    with pytest.raises(ValueError, match=r"\.keras"):
        later.filepath = str(tmp_path / "best.ckpt")
    model = model_with(hvdx.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)))
    with pytest.raises(ValueError, match="set `filepath` before fit"):
        fit(model, [later], epochs=1)
    later.filepath = str(tmp_path / "best.keras")  # set later, as Horovod's Spark estimator does
    weights_only = k3cb.BestModelCheckpoint(save_weights_only=True, filepath=str(tmp_path / "best.weights.h5"))
    x, y = data()
    history = fit(model, [later, weights_only], epochs=4, validation_data=(x, y))
    assert later.save_best_only and later.best == min(history.history["val_loss"])
    loaded = keras.models.load_model(tmp_path / "best.keras")
    assert type(loaded.optimizer).__module__ == "hvdx.keras3_optimizer"
    fresh = keras.models.clone_model(model)  # not compiled: the weights alone load
    fresh.load_weights(tmp_path / "best.weights.h5")
    for a, b in zip(fresh.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)  # both hold the best epoch's weights


# -- together ---------------------------------------------------------------------------------
def test_fit_with_every_callback_learns_the_digits(one_rank, tmp_path):
    from tests.multirank import digits

    x_train, x_test, y_train, y_test = digits.split()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    optimizer = hvdx.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [k3cb.BroadcastGlobalVariablesCallback(0), k3cb.MetricAverageCallback(),
                 k3cb.LearningRateWarmupCallback(0.1, warmup_epochs=2),
                 k3cb.BestModelCheckpoint(filepath=str(tmp_path / "best.weights.h5"), save_weights_only=True)]
    history = model.fit(x_train, y_train, batch_size=32, epochs=5, verbose=0, validation_data=(x_test, y_test),
                        callbacks=callbacks)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    assert accuracy > 0.9 and history.history["loss"][-1] < 0.5 * history.history["loss"][0]
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.1) and (tmp_path / "best.weights.h5").exists()


#: On a stack without Keras 3 no launch is asked for this check (its test is skipped there).
CHECKS = [suite.check("keras3_callbacks.fit", "2x2", timeout=420)] if HAS_KERAS3 else []


@suite.runs(*CHECKS)
def test_the_callbacks_on_two_nodes_make_the_ranks_agree_and_learn(ranks):
    """2 nodes x 2 ranks, seeded apart, `fit` of a Keras 3 MLP on the digits with the broadcast,
    the metric average, the warm-up and (rank 0) the best-model checkpoint: every rank ends with
    bitwise-identical weights and optimizer state, the averaged metrics are the mean of the
    ranks' own and the same on every rank, the rate after warm-up is initial_lr, it learns."""
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, result in ranks.items():
        assert result["keras"].startswith("3."), result
        assert result["spread_before"] > 0.0 and result["spread"] == 0.0, (rank, result["spread"])
        assert result["optimizer_spread"] == 0.0, (rank, result["optimizer_spread"])
        assert result["lr"] == pytest.approx(result["initial_lr"]), (rank, result["lr"])
        assert result["accuracy"] > 0.85, (rank, result["accuracy"])
        assert result["history"]["val_loss"] == [e["val_loss"] for e in result["averaged"]]
        assert result["averaged"] == ranks[0]["averaged"], rank
    for epoch, averaged in enumerate(ranks[0]["averaged"]):
        own = [ranks[r]["own"][epoch] for r in range(4)]
        assert len({o["val_loss"] for o in own}) > 1  # the ranks' own differ: averaging did something
        for key, value in averaged.items():
            assert value == pytest.approx(np.mean([o[key] for o in own]), rel=1e-12), (epoch, key)
    assert ranks[0]["checkpoint"] and ranks[0]["checkpoint_loads"]
