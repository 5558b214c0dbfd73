"""A Keras 3 user's job on hvdx, run in the suite's "keras3:2x2" launch (tf.keras left to
TensorFlow: Keras 3, no $TF_USE_LEGACY_KERAS):

- `train_resume`: `import keras`, then `import hvdx.keras as hvd` (the order a Keras 3 user
  writes); an MLP on the digits, each rank seeded apart, `fit` through
  `hvd.DistributedOptimizer` with Horovod's callbacks (broadcast, metric average, LR warm-up);
  every rank saves a `.keras` checkpoint of its own (the residuals differ per rank), loads it
  with `hvd.load_model`, checks that the wrapper, its strategy and residuals came back, and
  trains on from it. Optionally under Keras 3's mixed_float16 policy.
"""
from __future__ import annotations

import os
import tempfile

import keras
import numpy as np

import hvdx.keras as hvd
from tests.multirank import digits
from tests.multirank.rank import spread

EPOCHS, RESUMED_EPOCHS = 4, 2
BATCH = 16  # per rank


def _model() -> keras.Model:
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10), keras.layers.Activation("linear", dtype="float32")])


def _residuals(optimizer) -> list:
    """This rank's residuals (error feedback) as arrays, in a fixed order ([] for dense strategies)."""
    from hvdx.wrapper_core import residual_state

    state = residual_state(optimizer.aggregator)
    return [np.asarray(state[key]) for key in sorted(state)]


def check_train_resume(topo, communication: str, mixed_precision: bool = False) -> dict:
    """Trains, saves, loads and trains on; returns what the test asserts (see the module)."""
    topo = hvd.init()
    policy = keras.mixed_precision.global_policy()
    if mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x_train, x_test, y_train, y_test = digits.split()
        shard = len(x_train) // hvd.size() // BATCH * BATCH  # as many steps on every rank
        x = x_train[hvd.rank()::hvd.size()][:shard]
        y = y_train[hvd.rank()::hvd.size()][:shard]
        keras.utils.set_random_seed(hvd.rank())  # apart before the broadcast
        model = _model()
        tag = f"{communication}.{int(mixed_precision)}"
        before = spread([v.numpy() for v in model.variables], f"{tag}.before")
        lr = 0.02 * hvd.size()
        options = {"density": 0.05} if communication in ("hitopk", "sparse_allgather") else {}
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9), communication=communication, **options)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                     hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2)]
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, callbacks=callbacks, verbose=0, shuffle=False)
        residuals = _residuals(model.optimizer)
        path = os.path.join(tempfile.mkdtemp(prefix="hvdx-keras3-"), f"rank-{hvd.rank()}.keras")
        model.save(path)
        loaded = hvd.load_model(path)
        restored = _residuals(loaded.optimizer)
        same_residuals = len(restored) == len(residuals) and all(
            np.array_equal(a, b) for a, b in zip(residuals, restored))
        same_weights = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights()))
        resumed = loaded.fit(x, y, batch_size=BATCH, epochs=RESUMED_EPOCHS, verbose=0, shuffle=False)
        logits = loaded.predict(x_test, verbose=0)
        return {"keras": keras.__version__, "spread_before": before,
                "spread": spread([v.numpy() for v in loaded.variables], tag),
                "loss": [float(v) for v in history.history["loss"] + resumed.history["loss"]],
                "accuracy": float(np.mean(np.argmax(logits, axis=1) == y_test)),
                "lr": float(np.asarray(model.optimizer.learning_rate)), "initial_lr": lr,
                "residuals": len(residuals), "nonzero_residuals": int(sum(np.count_nonzero(r) for r in residuals)),
                "same_residuals": bool(same_residuals), "same_weights": bool(same_weights),
                "loaded": {"module": type(loaded.optimizer).__module__,
                           "communication": type(loaded.optimizer.communication).__name__,
                           "is_sgd": isinstance(loaded.optimizer, keras.optimizers.SGD)},
                "compute_dtype": model.layers[0].compute_dtype}
    finally:
        keras.mixed_precision.set_global_policy(policy)


CHECKS = {"train_resume": check_train_resume}
