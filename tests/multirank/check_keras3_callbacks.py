"""hvdx's Keras 3 versions of Horovod's callbacks (hvdx/keras/keras3_callbacks.py) on m x n ranks.

- `fit`: a Keras 3 MLP on scikit-learn's digits, each rank seeded differently, trained by `fit`
  through hvdx.DistributedOptimizer(keras.optimizers.SGD(momentum=0.9)) with the broadcast,
  the metric average, the learning-rate warm-up and (on rank 0) the best-model checkpoint:
  what each rank holds after it (weights' spread over the ranks, its own and the averaged
  metrics, the rate, test accuracy, the checkpoint).
"""
import os
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from tests.multirank import digits


def _spread(values: np.ndarray, name: str) -> float:
    """max - min over the ranks of each element, the largest (0.0: bitwise identical)."""
    top = hvd.allreduce(tf.constant(values), op=hvd.Max, name=f"{name}.max")
    bottom = hvd.allreduce(tf.constant(values), op=hvd.Min, name=f"{name}.min")
    return float(tf.reduce_max(top - bottom))


def check_fit(topo, epochs: int = 5, warmup_epochs: int = 2) -> dict:
    """See the module. The rank's own validation metrics (its quarter of the test set) are
    read by a callback placed before MetricAverageCallback, the averaged ones after it and in
    the history. Where the keras package is not Keras 3 it trains nothing and says so."""
    import importlib.metadata

    version = importlib.metadata.version("keras")
    if int(version.split(".")[0]) < 3:
        return {"keras": version, "skipped": "no Keras 3 on this stack"}
    import keras

    import hvdx
    from hvdx.keras import keras3_callbacks as cb

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.logs = []

        def on_epoch_end(self, epoch, logs=None):
            self.logs.append({k: float(v) for k, v in logs.items()})

    x_train, x_test, y_train, y_test = digits.split()
    per_rank, per_rank_test = len(x_train) // topo.size, len(x_test) // topo.size  # equal shards, equal steps
    x_mine, y_mine = x_train[topo.rank::topo.size][:per_rank], y_train[topo.rank::topo.size][:per_rank]
    x_val, y_val = x_test[topo.rank::topo.size][:per_rank_test], y_test[topo.rank::topo.size][:per_rank_test]
    keras.utils.set_random_seed(topo.rank)  # the ranks start apart
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    initial_lr = 0.05 * topo.size
    optimizer = hvdx.DistributedOptimizer(keras.optimizers.SGD(initial_lr, momentum=0.9))
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = np.concatenate([np.asarray(w).ravel() for w in model.trainable_variables])
    spread_before = _spread(before, "k3cb.before")
    own, averaged = Record(), Record()
    callbacks = [cb.BroadcastGlobalVariablesCallback(0), own, cb.MetricAverageCallback(), averaged,
                 cb.LearningRateWarmupCallback(initial_lr, warmup_epochs=warmup_epochs)]
    directory = tempfile.mkdtemp(prefix="hvdx-k3cb-")
    best = os.path.join(directory, "best.weights.h5")
    if topo.rank == 0:
        callbacks.append(cb.BestModelCheckpoint(monitor="val_loss", save_weights_only=True, filepath=best))
    history = model.fit(x_mine, y_mine, batch_size=16, epochs=epochs, verbose=0, validation_data=(x_val, y_val),
                        callbacks=callbacks)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    weights = np.concatenate([np.asarray(w).ravel() for w in model.trainable_variables])
    optimizer_state = np.concatenate([np.asarray(v).ravel() for v in optimizer.variables])
    result = {"keras": version, "spread_before": spread_before, "spread": _spread(weights, "k3cb.after"),
              "optimizer_spread": _spread(optimizer_state, "k3cb.opt"), "accuracy": float(accuracy),
              "own": own.logs, "averaged": averaged.logs,
              "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
              "initial_lr": initial_lr, "lr": float(optimizer.learning_rate.numpy()),
              "checkpoint": os.path.exists(best) if topo.rank == 0 else None}
    if topo.rank == 0:
        fresh = keras.models.clone_model(model)
        fresh.load_weights(best)  # the best epoch's weights load into the architecture
        result["checkpoint_loads"] = len(fresh.get_weights()) == len(model.get_weights())
    print(f"keras3 callbacks rank {topo.rank}: test accuracy {accuracy:.4f}, lr {result['lr']:g}", flush=True)
    return result


CHECKS = {"fit": check_fit}
