""""Change the import only" holds for Horovod scripts: every name of Horovod's API is in hvdx's
namespaces, the optimizer wrapper is an instance of the wrapped optimizer's class, a
tf.compat.v1.train optimizer can be wrapped, and Horovod's LR callbacks (momentum correction
included) drive an hvdx-wrapped new-style SGD.

Single-rank checks run in this process (after hvdx.init()); the averaging on 2 nodes x 1 rank
runs in the 2x1 launch (tests/multirank/check_horovod_api.py).
"""
import json
import types

import horovod.tensorflow as horovod_tf
import horovod.tensorflow.keras as horovod_keras
import horovod.tensorflow.keras.callbacks as horovod_callbacks
import numpy as np
import pytest
import tensorflow as tf

import hvdx
import hvdx.keras
import hvdx.keras.callbacks
import hvdx.keras.horovod_callbacks
import hvdx.tensorflow
import hvdx.tensorflow.keras
from hvdx import legacy_keras
from hvdx.optimizer_v1 import DistributedOptimizerV1
from hvdx.zoo import mlp
from tests import suite
from tests.multirank.check_horovod_api import BATCH, V1_STEPS, linear_data

# Horovod's callbacks that work through a Keras backend module, and hvdx's versions of them on
# tf.keras's backend: Horovod's own fail from TensorFlow 2.16 on (it hands them Keras 3's).
KERAS3_TF = tuple(int(p) for p in tf.__version__.split(".")[:2]) >= legacy_keras.KERAS3_SINCE
BACKEND_CALLBACKS = [
    pytest.param(horovod_callbacks, id="horovod", marks=pytest.mark.skipif(
        KERAS3_TF, reason=f"Horovod 0.28.1 hands its callbacks Keras 3's backend under TensorFlow {tf.__version__}")),
    pytest.param(hvdx.keras.horovod_callbacks, id="hvdx")]


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvdx.init()


# -- the names -------------------------------------------------------------------------------

NAMESPACES = {
    "hvdx.tensorflow": (horovod_tf, hvdx.tensorflow, {
        "DistributedGradientTape", "DistributedOptimizer", "PartialDistributedGradientTape", "broadcast_variables",
        "elastic", "init", "keras", "shutdown"}),
    "hvdx.keras": (horovod_keras, hvdx.keras, {"DistributedOptimizer", "callbacks", "elastic", "init", "load_model",
                                               "shutdown"}),
    "hvdx.tensorflow.keras": (horovod_keras, hvdx.tensorflow.keras, {
        "DistributedOptimizer", "callbacks", "elastic", "init", "load_model", "shutdown"}),
    "hvdx.keras.callbacks": (horovod_callbacks, hvdx.keras.callbacks, {
        "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
        "LearningRateWarmupCallback", "MetricAverageCallback"}),
}


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_every_public_name_of_horovods_module_is_in_hvdxs(namespace):
    horovod_module, hvdx_module, expected_overrides = NAMESPACES[namespace]
    names = [n for n in dir(horovod_module) if not n.startswith("_")]
    assert len(names) > 5
    missing = [n for n in names if not hasattr(hvdx_module, n)]
    assert not missing, f"{namespace} lacks Horovod's {missing}"
    overrides = {n for n in names if getattr(hvdx_module, n) is not getattr(horovod_module, n)}
    print(f"{namespace} overrides {sorted(overrides)}")
    assert overrides == expected_overrides
    exported = set(hvdx_module.__all__)  # all but the modules from outside Horovod (tf, os, ...)
    foreign = {n for n in names if isinstance(getattr(horovod_module, n), types.ModuleType)
               and not getattr(horovod_module, n).__name__.startswith("horovod")}
    assert set(names) - foreign <= exported and not foreign & exported
    assert all(hasattr(hvdx_module, n) for n in exported)


def test_the_names_issue_19_found_missing_are_there():
    for name in ("Max", "Min", "Product", "cuda_built", "SyncBatchNormalization", "elastic",
                 "PartialDistributedGradientTape"):
        assert hasattr(hvdx.tensorflow, name), name
    assert hvdx.tensorflow.Max is horovod_tf.Max
    # hvd.elastic is hvdx's (Horovod's API whose states also reset hvdx): every public name of
    # Horovod's, its states subclasses of Horovod's
    assert hvdx.keras.elastic is hvdx.tensorflow.elastic is hvdx.elastic
    for name in [n for n in dir(horovod_keras.elastic) if not n.startswith("_")
                 and not isinstance(getattr(horovod_keras.elastic, n), types.ModuleType)]:
        assert hasattr(hvdx.elastic, name), name
    assert issubclass(hvdx.keras.elastic.KerasState, horovod_keras.elastic.KerasState)
    assert hvdx.keras.allreduce is horovod_keras.allreduce  # the Keras flavour (values in, values out)
    assert hvdx.tensorflow.keras.DistributedOptimizer is hvdx.DistributedOptimizer
    assert hvdx.tensorflow.keras.callbacks is hvdx.keras.callbacks
    if not legacy_keras.tf_keras_is_keras3():  # Keras 2's are Horovod's (Keras 3's: tests/test_keras3.py)
        warmup = hvdx.keras.callbacks.LearningRateWarmupCallback
        assert warmup is hvdx.keras.horovod_callbacks.LearningRateWarmupCallback
        assert issubclass(warmup, horovod_callbacks.LearningRateWarmupCallback)


def test_a_name_horovod_gains_later_is_found(monkeypatch):
    marker = object()
    monkeypatch.setattr(horovod_tf, "gained_later", marker, raising=False)
    monkeypatch.setattr(horovod_keras, "gained_later", marker, raising=False)
    assert hvdx.tensorflow.gained_later is marker and hvdx.keras.gained_later is marker
    assert hvdx.tensorflow.keras.gained_later is marker
    with pytest.raises(AttributeError, match="no attribute 'not_horovods'"):
        hvdx.tensorflow.not_horovods  # noqa: B018


def test_an_undeclared_override_fails_at_import():
    from hvdx.tensorflow import _horovod_api

    with pytest.raises(ImportError, match="list it in `own`"):
        _horovod_api.reexport(horovod_tf, {"__name__": "fake", "allreduce": object()}, own=())
    with pytest.raises(ImportError, match="does not define"):
        _horovod_api.reexport(horovod_tf, {"__name__": "fake"}, own=("init",))
    namespace = {"__name__": "fake", "init": object()}
    exported = _horovod_api.reexport(horovod_tf, namespace, own=("init",), lazy=("keras",))
    assert namespace["allreduce"] is horovod_tf.allreduce and "keras" not in namespace
    assert "init" in exported and "keras" in exported and "tf" in namespace and "tf" not in exported


def test_partial_distributed_gradient_tape_keeps_local_layers_local():
    local, shared = tf.keras.layers.Dense(2), tf.keras.layers.Dense(2)
    x = tf.ones((3, 4))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(shared(local(x)))
    tape = hvdx.tensorflow.PartialDistributedGradientTape(tape, local_layers=local)
    assert [id(v) for v in tape._local_sources] == [id(v) for v in local.trainable_weights]
    grads = tape.gradient(loss, local.trainable_weights + shared.trainable_weights)
    assert all(g is not None for g in grads)
    with pytest.raises(ValueError, match="tf.keras.layers.Layer"):
        hvdx.tensorflow.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[local, "dense"])


# -- isinstance --------------------------------------------------------------------------------

@pytest.mark.keras2  # Horovod's Keras 2 API as written (Keras 3's: tests/test_keras3*.py)
@pytest.mark.parametrize("make", [lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
                                  lambda: tf.keras.optimizers.Adam(0.01),
                                  lambda: hvdx.optimizers.LARS(0.1)], ids=["SGD", "Adam", "LARS"])
def test_the_wrapper_is_an_instance_of_the_wrapped_class(make):
    inner = make()
    opt = hvdx.DistributedOptimizer(inner)
    cls = type(inner)
    assert isinstance(opt, cls) and isinstance(opt, hvdx.DistributedOptimizer)
    assert isinstance(opt, tf.keras.optimizers.Optimizer)
    assert type(opt).__name__ == "DistributedOptimizer" and opt.inner_optimizer is inner
    assert type(hvdx.DistributedOptimizer(make())) is type(opt)  # one class per wrapped class
    assert hvdx.keras.DistributedOptimizer is hvdx.DistributedOptimizer
    assert opt.learning_rate is inner.learning_rate
    # the wrapped class's own methods run on the wrapped optimizer, never on the wrapper's state
    if cls is hvdx.optimizers.LARS:
        assert opt.trust_ratios.__self__ is inner and opt.observe_aggregation.__self__ is inner
    assert type(opt).update_step is tf.keras.optimizers.Optimizer.update_step
    config = json.loads(json.dumps(tf.keras.optimizers.serialize(opt)))
    assert config["registered_name"] == "hvdx>DistributedOptimizer" and config["class_name"] == "DistributedOptimizer"
    assert tf.keras.utils.get_registered_object("hvdx>DistributedOptimizer") is hvdx.DistributedOptimizer
    again = tf.keras.optimizers.deserialize(config)
    assert type(again) is type(opt) and again.inner_optimizer.get_config() == inner.get_config()
    assert type(opt).from_config(opt.get_config()).get_config() == opt.get_config()  # Horovod's test_from_config
    with pytest.raises(ValueError, match="already an hvdx.DistributedOptimizer"):
        hvdx.DistributedOptimizer(opt)


def test_hyper_parameters_read_through_the_wrapper():
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True))
    assert opt.nesterov is True and float(opt.momentum) == pytest.approx(0.9)
    opt.momentum = 0.5
    assert opt.inner_optimizer.momentum == 0.5 and float(opt.momentum) == pytest.approx(0.5)
    assert not hasattr(hvdx.DistributedOptimizer(tf.keras.optimizers.Adam()), "momentum")
    rms = hvdx.DistributedOptimizer(tf.keras.optimizers.RMSprop(momentum=0.3))
    assert rms.momentum == 0.3  # RMSprop branches on it in Python: stays a number


@pytest.mark.keras2  # Horovod's Keras 2 API as written (Keras 3's: tests/test_keras3*.py)
def test_legacy_optimizers_keep_working_but_are_not_subclassed():
    inner = tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9)
    opt = hvdx.DistributedOptimizer(inner)
    assert type(opt) is hvdx.DistributedOptimizer and not isinstance(opt, tf.keras.optimizers.legacy.Optimizer)
    w = tf.Variable([1.0, 2.0])
    opt.apply_gradients([(tf.constant([1.0, 1.0]), w)])
    np.testing.assert_allclose(w.numpy(), [0.9, 1.9])
    assert float(tf.keras.backend.get_value(opt.momentum)) == pytest.approx(0.9)


def small_model():
    return mlp(3, (4,), 1, activation=None, seed=0)


@pytest.mark.keras2  # Horovod's Keras 2 API as written (Keras 3's: tests/test_keras3*.py)
@pytest.mark.parametrize("fmt", ["keras", "h5", "savedmodel"])
def test_a_saved_model_loads_with_a_wrapper_of_the_same_class(fmt, tmp_path):
    x, y = linear_data(0)
    model = small_model()
    model.compile(hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9)), "mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    path = str(tmp_path / {"keras": "m.keras", "h5": "m.h5", "savedmodel": "saved"}[fmt])
    model.save(path)
    loaded = hvdx.load_model(path)
    assert isinstance(loaded.optimizer, tf.keras.optimizers.SGD)
    assert isinstance(loaded.optimizer, hvdx.DistributedOptimizer)
    assert loaded.optimizer.inner_optimizer.get_config() == model.optimizer.inner_optimizer.get_config()
    for mine, theirs in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


@pytest.mark.keras2  # Horovod's Keras 2 API as written (Keras 3's: tests/test_keras3*.py)
def test_mixed_precision_wraps_the_wrapper():
    opt = tf.keras.mixed_precision.LossScaleOptimizer(hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)))
    assert isinstance(opt.inner_optimizer, tf.keras.optimizers.SGD)
    x, y = linear_data(0)
    model = small_model()
    model.compile(opt, "mse")
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)
    assert model.evaluate(x, y, verbose=0) < before


# -- a tf.compat.v1.train optimizer --------------------------------------------------------------

def gradients(w, x, y):
    """d/dw of mean((x w[:-1] + w[-1] - y)^2), in float64."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    r = x @ w[:-1].reshape(-1, 1) + w[-1] - y
    return np.concatenate([(2.0 / len(x)) * (x.T @ r).ravel(), [2.0 / len(x) * r.sum()]])


def v1_reference(rank_data, steps, lr, momentum=None):
    w, accum, out = np.zeros(rank_data[0][0].shape[1] + 1), None, []
    for _ in range(steps):
        g = np.mean([gradients(w, x, y) for x, y in rank_data], axis=0)
        if momentum is None:
            w = w - lr * g
        else:  # tf.compat.v1.train.MomentumOptimizer: accum = m accum + g; w -= lr accum
            accum = g if accum is None else momentum * accum + g
            w = w - lr * accum
        out.append(w)
    return np.array(out)


@pytest.mark.parametrize("passes", [1, 2])
def test_v1_optimizer_in_a_graph_and_session(passes):
    x, y = linear_data(0)
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.zeros((3, 1)))
        b = tf.compat.v1.get_variable("b", initializer=tf.zeros((1,)))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvdx.tensorflow.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.05, 0.9),
                                                   backward_passes_per_step=passes)
        assert isinstance(opt, DistributedOptimizerV1) and isinstance(opt, tf.compat.v1.train.Optimizer)
        train = opt.minimize(loss, global_step=step)
        assert opt.get_slot_names() == ["momentum"] and opt.get_slot(w, "momentum") is not None
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            seen = []
            for _ in range(V1_STEPS * passes):
                session.run(train)
                seen.append(np.concatenate([session.run(w).ravel(), session.run(b)]))
            assert session.run(step) == V1_STEPS * passes  # every pass counts, as in Horovod
    applied = np.array(seen[passes - 1::passes])
    # N passes of the same gradient, summed (Horovod's default: not averaged)
    expected = v1_reference([(x, y)], V1_STEPS, 0.05 * passes, momentum=0.9)
    np.testing.assert_allclose(applied, expected, rtol=1e-5, atol=1e-6)


def test_v1_optimizer_eagerly_with_an_hvdx_strategy():
    x, y = linear_data(0)
    w, b = tf.Variable(tf.zeros((3, 1))), tf.Variable(tf.zeros((1,)))
    opt = hvdx.tensorflow.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05),
                                               communication="hitopk", density=1.0)
    assert opt.aggregator.strategy.key == "hitopk"
    seen = []
    for _ in range(V1_STEPS):
        opt.minimize(lambda: tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y)), var_list=[w, b])
        seen.append(np.concatenate([w.numpy().ravel(), b.numpy()]))
    np.testing.assert_allclose(np.array(seen), v1_reference([(x, y)], V1_STEPS, 0.05), rtol=1e-5, atol=1e-6)


def test_v1_options_and_errors():
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    adasum = hvdx.tensorflow.DistributedOptimizer(sgd, op=hvdx.tensorflow.Adasum)
    assert type(adasum).__name__ == "_DistributedAdasumOptimizer"  # Horovod's own delta Adasum
    with pytest.raises(ValueError, match="Adasum"):
        hvdx.tensorflow.DistributedOptimizer(sgd, op=hvdx.tensorflow.Adasum, communication="hitopk")
    with pytest.raises(ValueError):
        hvdx.tensorflow.DistributedOptimizer(sgd, communication="no-such-strategy")
    with pytest.raises(ValueError, match="tf.compat.v1.train optimizer"):
        DistributedOptimizerV1(tf.keras.optimizers.SGD())
    keras_opt = hvdx.tensorflow.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), None, True)  # Horovod's order
    assert isinstance(keras_opt, hvdx.DistributedOptimizer) and isinstance(keras_opt, tf.keras.optimizers.SGD)
    assert len(adasum.variables()) == 0 and isinstance(hvdx.tensorflow.DistributedOptimizer(sgd).variables(), list)


@pytest.mark.keras2  # Horovod's Keras 2 API as written (Keras 3's: tests/test_keras3*.py)
@pytest.mark.parametrize("make", [
    lambda: horovod_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
    lambda: horovod_keras.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1)),
    lambda: horovod_tf.DistributedOptimizer(tf.keras.optimizers.Adam()),
], ids=["keras", "keras.legacy", "tensorflow.keras"])
def test_horovods_keras_wrapper_is_refused_not_averaged_twice(make):
    with pytest.raises(ValueError, match="got Horovod's DistributedOptimizer .*averaged twice.*"
                                         r"pass the optimizer it wraps, hvdx.DistributedOptimizer\(tf.keras"):
        hvdx.DistributedOptimizer(make())
    assert hvdx.wrapped.is_horovods(make()) and not hvdx.wrapped.is_horovods(tf.keras.optimizers.SGD(0.1))
    assert not hvdx.wrapped.is_horovods(hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))


def test_horovods_v1_wrapper_is_refused_not_averaged_twice():
    horovods = horovod_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(ValueError, match="hvdx.tensorflow.DistributedOptimizer wraps a plain tf.compat.v1 optimizer"):
        hvdx.tensorflow.DistributedOptimizer(horovods)
    assert not hvdx.wrapped.is_horovods(hvdx.tensorflow.DistributedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)))


# -- Horovod's LR callbacks ------------------------------------------------------------------------

class Record(tf.keras.callbacks.Callback):
    """The learning rate and momentum each batch runs with (after the LR callbacks' changes)."""

    def __init__(self):
        super().__init__()
        self.lr, self.momentum = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lr.append(float(tf.keras.backend.get_value(self.model.optimizer.lr)))
        self.momentum.append(float(tf.keras.backend.get_value(self.model.optimizer.momentum)))


def keras_sgd_reference(rank_data, lrs, momenta, batch):
    """Keras' SGD (m = momentum m - lr g; w += m) from zeros, the batches in order, the
    gradients averaged over the ranks."""
    w, m = np.zeros(rank_data[0][0].shape[1] + 1), 0.0
    batches = len(rank_data[0][0]) // batch
    for t, (lr, momentum) in enumerate(zip(lrs, momenta)):
        k = t % batches
        g = np.mean([gradients(w, x[k * batch:(k + 1) * batch], y[k * batch:(k + 1) * batch])
                     for x, y in rank_data], axis=0)
        m = momentum * m - lr * g
        w = w + m
    return w


@pytest.mark.keras2  # Horovod's Keras 2 API as written (Keras 3's: tests/test_keras3*.py)
@pytest.mark.parametrize("callbacks", BACKEND_CALLBACKS)
@pytest.mark.parametrize("legacy", [False, True], ids=["SGD", "legacy.SGD"])
def test_lr_schedule_callback_with_momentum_correction_reaches_the_step(legacy, callbacks):
    x, y = linear_data(0)
    model = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(1, kernel_initializer="zeros")])
    sgd = (tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD)(0.2, momentum=0.9)
    model.compile(hvdx.keras.DistributedOptimizer(sgd), "mse")
    record = Record()
    schedule = callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=1)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[schedule, record])
    steps = len(x) // BATCH
    assert record.lr == pytest.approx([0.2] * steps + [0.1] * steps + [0.05] * steps)
    corrected = [0.9] * steps + ([0.45] + [0.9] * (steps - 1)) * 2  # m new_lr / old_lr on the changing batch
    assert record.momentum == pytest.approx(corrected)
    weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    np.testing.assert_allclose(weights, keras_sgd_reference([(x, y)], record.lr, record.momentum, BATCH),
                               rtol=1e-4, atol=1e-6)
    uncorrected = keras_sgd_reference([(x, y)], record.lr, [0.9] * len(record.lr), BATCH)
    assert np.abs(weights - uncorrected).max() > 1e-3  # the corrected momentum made a difference
    assert float(tf.keras.backend.get_value(model.optimizer.momentum)) == pytest.approx(0.9)  # restored


@pytest.mark.keras2  # Horovod's Keras 2 API as written (Keras 3's: tests/test_keras3*.py)
@pytest.mark.parametrize("name", ["MetricAverageCallback", "LearningRateScheduleCallback",
                                  "LearningRateWarmupCallback"])
def test_hvdx_backend_callbacks_are_horovods_on_tf_keras_backend(name):
    """hvdx's versions are Horovod's classes (isinstance holds, same arguments) whose backend
    is tf.keras's, not the standalone keras package's Horovod hands them."""
    ours = getattr(hvdx.keras.horovod_callbacks, name)
    assert issubclass(ours, getattr(horovod_callbacks, name)) and issubclass(ours, tf.keras.callbacks.Callback)
    args = {"MetricAverageCallback": {}, "LearningRateScheduleCallback": dict(initial_lr=0.1, multiplier=0.5),
            "LearningRateWarmupCallback": dict(initial_lr=0.1, warmup_epochs=2)}[name]
    callback = ours(**args)
    assert callback.backend is tf.keras.backend
    assert getattr(callback, "initial_lr", 0.1) == 0.1


@pytest.mark.parametrize("callbacks", BACKEND_CALLBACKS)
def test_metric_average_callback_runs_in_fit(callbacks):
    """On one rank the average is the rank's own value; the two-rank average is checked in
    the 2x1 launch (test_metric_average_callback_averages_the_epoch_logs_over_two_ranks)."""
    x, y = linear_data(0)
    model = small_model()
    model.compile(hvdx.keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)), "mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[callbacks.MetricAverageCallback()])
    assert len(history.history["loss"]) == 2 and history.history["loss"][1] < history.history["loss"][0]
    assert set(history.history) >= {"loss", "mae"}


@pytest.mark.keras2  # Horovod's Keras 2 API as written (Keras 3's: tests/test_keras3*.py)
def test_warmup_callback_runs_with_hvdx_callbacks_and_lars():
    x, y = linear_data(0)
    model = small_model()
    opt = hvdx.keras.DistributedOptimizer(hvdx.optimizers.LARS(0.05, momentum=0.9))
    model.compile(opt, "mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[
        hvdx.keras.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=1, verbose=0),
        hvdx.keras.callbacks.LearningRateScheduleCallback(initial_lr=0.05, multiplier=0.5, start_epoch=1)])
    assert history.history["lr"][-1] == pytest.approx(0.05)  # size 1: the warm-up keeps initial_lr
    assert isinstance(opt.momentum, tf.Variable) and float(opt.momentum) == pytest.approx(0.9)
    assert opt.inner_optimizer.momentum == 0.9 and opt.inner_optimizer.get_config()["momentum"] == 0.9


# -- 2 nodes x 1 rank ---------------------------------------------------------------------------

HABITS = suite.check("horovod_api.habits", "2x1", timeout=420)


@pytest.mark.second_stack
@suite.runs(HABITS)
@pytest.mark.parametrize("kind", ["v1_graph", "v1_eager"])
def test_v1_optimizer_averages_over_two_ranks(ranks, kind):
    assert sorted(ranks) == [0, 1] and ranks[0]["size"] == 2
    np.testing.assert_array_equal(ranks[0][kind], ranks[1][kind])
    momentum = 0.9 if kind == "v1_graph" else None
    expected = v1_reference([linear_data(0), linear_data(1)], V1_STEPS, 0.05, momentum=momentum)
    np.testing.assert_allclose(np.array(ranks[0][kind]), expected, rtol=1e-5, atol=1e-6)


@suite.runs(HABITS)
def test_metric_average_callback_averages_the_epoch_logs_over_two_ranks(ranks):
    own = np.array([ranks[r]["lr_warmup"]["loss_own"] for r in (0, 1)])
    assert own.shape == (2, 3) and np.abs(own[0] - own[1]).min() > 1e-4  # the ranks' data differ
    for r in (0, 1):
        np.testing.assert_allclose(ranks[r]["lr_warmup"]["loss_averaged"], own.mean(axis=0), rtol=1e-6)


@suite.runs(HABITS)
def test_lr_warmup_callback_averages_and_warms_up_over_two_ranks(ranks):
    seen = ranks[0]["lr_warmup"]
    mine = {key: value for key, value in seen.items() if key != "loss_own"}  # the ranks' own losses differ
    assert mine == {key: value for key, value in ranks[1]["lr_warmup"].items() if key != "loss_own"}
    steps, size, warmup, target = len(linear_data(0)[0]) // BATCH, 2, 2, 0.05
    expected_lr = [target / size * ((epoch + (batch + 1) / steps) * (size - 1) / warmup + 1)
                   for epoch in range(warmup) for batch in range(steps)] + [target] * steps  # Horovod's formula
    assert seen["lr"] == pytest.approx(expected_lr)
    previous = [0.05] + seen["lr"][:-1]
    assert seen["momentum"] == pytest.approx([0.9 * new / old for new, old in zip(seen["lr"], previous)])
    assert seen["momentum_after"] == pytest.approx(0.9)
    np.testing.assert_allclose(
        seen["weights"], keras_sgd_reference([linear_data(0), linear_data(1)], seen["lr"], seen["momentum"], BATCH),
        rtol=1e-4, atol=1e-6)
