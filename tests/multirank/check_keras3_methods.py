"""hvdx's training methods beside the synchronous step under Keras 3, run in the suite's
"keras3:2x2" launch (tf.keras left to TensorFlow: Keras 3, no $TF_USE_LEGACY_KERAS):

- `fit`: `import keras`, a Keras 3 MLP on the digits, each rank seeded apart and on its own
  shard, `fit` with a plain Keras 3 optimizer and the one method driver
  (`hvdx.callbacks.TrainingMethodCallback`, or the method's own subclass): LocalSGD with
  DiLoCo's outer optimizer (of Keras 3: the default under Keras 3), streaming DiLoCo with
  4-bit outer gradients, AD-PSGD, ASSM and PASSM (the node's processes on one shared model,
  their own `train_step` in place of Keras 3's). After `fit` every rank holds the same model bitwise, it
  classifies the digits, and the method's `state()` goes through JSON into a new one.
"""
from __future__ import annotations

import json
import os
import tempfile

import keras
import numpy as np

import hvdx.keras as hvd
from tests.multirank import digits
from tests.multirank.rank import spread

BATCH = 16  # per rank


def _model() -> keras.Model:
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def _driver(method: str):
    """(the callback driving `method`, a fresh method of the same options for the state's round trip)."""
    from hvdx.callbacks import TrainingMethodCallback

    if method == "localsgd":
        from hvdx.localsgd import LocalSGD

        make = lambda: LocalSGD(sync_every=8)  # noqa: E731
        return TrainingMethodCallback(make()), make
    if method == "streaming4":
        from hvdx.streaming_diloco import StreamingDiLoCo

        make = lambda: StreamingDiLoCo(sync_every=8, fragments=2, overlap=1, bits=4)  # noqa: E731
        return TrainingMethodCallback(make()), make
    if method == "adpsgd":
        import hvdx.adpsgd

        return hvdx.adpsgd.ADPSGDCallback(average_every_epoch=True, seed=7), None
    if method in ("assm", "passm"):
        import hvdx.asynchronous

        make = hvdx.asynchronous.METHODS[method]
        return hvdx.asynchronous.SharedModelCallback(make()), make
    raise ValueError(f"no Keras 3 method check for {method!r}")


def check_fit(topo, method: str, epochs: int = 4) -> dict:
    """Trains the digits MLP with `method` in Keras 3's `fit`; returns what the test asserts."""
    hvd.init()
    x_train, x_test, y_train, y_test = digits.split()
    shard = len(x_train) // hvd.size() // BATCH * BATCH  # as many steps on every rank
    x = x_train[hvd.rank()::hvd.size()][:shard]
    y = y_train[hvd.rank()::hvd.size()][:shard]
    keras.utils.set_random_seed(hvd.rank())  # apart: the method's start makes them one
    model = _model()
    # DiLoCo's outer Nesterov (0.7, 0.9) multiplies the inner steps' progress: a gentler inner rate
    inner_rate = 0.02 if method == "localsgd" else 0.05
    model.compile(optimizer=keras.optimizers.SGD(inner_rate, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    driver, make = _driver(method)
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[driver])
    result = {"keras": keras.__version__, "model_keras": type(model).__module__.split(".")[0],
              "spread": spread([v.numpy() for v in model.trainable_variables], f"keras3.{method}"),
              "loss": [float(v) for v in history.history["loss"]],
              "accuracy": float(model.evaluate(x_test, y_test, verbose=0)[1]), "stats": _jsonable(driver.stats)}
    if make is not None:
        state = json.loads(json.dumps(driver.method.state()))
        fresh = make()
        fresh.restore(state)
        result.update(state=state, restored=fresh.state() == state)
        if hasattr(driver.method, "outer_optimizer"):
            result.update(outer_keras=type(driver.method.outer_optimizer).__module__.split(".")[0])
    return result


def check_daso(topo, epochs: int = 4) -> dict:
    """hvdx.DASO on Keras 3 (module docstring); returns what the test asserts."""
    import hvdx
    import hvdx.daso
    import tensorflow as tf

    hvd.init()
    x_train, x_test, y_train, y_test = digits.split()
    shard = len(x_train) // hvd.size() // BATCH * BATCH
    x = x_train[hvd.rank()::hvd.size()][:shard]
    y = y_train[hvd.rank()::hvd.size()][:shard]
    overflowing = x.copy()
    if hvd.rank() == 1:  # in the warm-up (whose epochs' losses feed no plateau detection: this one is NaN)
        overflowing[5] = 1e30  # its node's loss scaler skips that step on both its ranks
    keras.utils.set_random_seed(hvd.rank())  # apart: DASO's first step puts every rank on rank 0's parameters
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model()
        opt = hvdx.DASO(keras.optimizers.SGD(0.05, momentum=0.9), total_epochs=epochs + 1, warmup_epochs=2,
                        cooldown_epochs=1, max_global_skips=4)
        model.compile(optimizer=opt, loss=loss, metrics=["accuracy"])
        model.fit(overflowing, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[hvdx.daso.DASOCallback()])
        first = opt._sync.transport
        scales = hvd.allgather(tf.reshape(tf.cast(opt.dynamic_scale, tf.float32), [1]), name="keras3.daso.scale")
        history = model.fit(x, y, batch_size=BATCH, initial_epoch=2, epochs=epochs, verbose=0,
                            callbacks=[hvdx.daso.DASOCallback()])
        weights = [v.numpy() for v in model.trainable_variables]
        path = os.path.join(tempfile.gettempdir(), f"hvdx-keras3-daso-{os.getppid()}-{hvd.rank()}.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        os.remove(path)
        restored = loaded.optimizer
        result = {
            "keras": keras.__version__, "type": f"{type(opt).__module__}.{type(opt).__name__}",
            "method": isinstance(opt, hvdx.daso.DASOMethod), "loss_scaled": isinstance(opt, keras.optimizers.LossScaleOptimizer),
            "compute_dtype": model.layers[0].compute_dtype,
            "spread_before_load": spread(weights, "keras3.daso"),
            "loss": [float(v) for v in history.history["loss"]],
            "accuracy": float(model.evaluate(x_test, y_test, verbose=0)[1]),
            "starts": sum(a.start_group is not None for a in opt.history),
            "blocking": sum(a.blocking_group is not None for a in opt.history),
            "transports": {"first_closed": first.closed, "second_closed": opt._sync.transport.closed,
                           "new": opt._sync.transport is not first},
            "loss_scales": [float(s) for s in scales],
            "loaded_type": f"{type(restored).__module__}.{type(restored).__name__}",
            "schedule_restored": restored.schedule.state() == opt.schedule.state(),
            "weights_restored": all(np.array_equal(a.numpy(), b) for a, b in zip(loaded.trainable_variables, weights)),
        }
        loaded.fit(x, y, batch_size=BATCH, initial_epoch=epochs, epochs=epochs + 1, verbose=0,
                   callbacks=[hvdx.daso.DASOCallback()])
        result.update(epochs_after_load=restored.schedule.epoch,
                      spread=spread([v.numpy() for v in loaded.trainable_variables], "keras3.daso.loaded"),
                      accuracy_after_load=float(loaded.evaluate(x_test, y_test, verbose=0)[1]))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return result


def _jsonable(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool, type(None), dict, list))}


CHECKS = {"fit": check_fit, "daso": check_daso}
