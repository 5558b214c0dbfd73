"""A rank script: a Keras 3 model (tf.keras left to TensorFlow: the caller removes
$TF_USE_LEGACY_KERAS) trained on the digits in a custom loop with
hvdx.DistributedGradientTape, after hvdx.broadcast_variables; and hvdx's Keras entry points
reached under Keras 3 as tf.keras. Run alone (one rank) by tests/test_keras3.py, under
horovodrun by its multi-rank test."""
import argparse

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvdx
import hvdx.keras
from hvdx import legacy_keras
from tests.multirank import digits
from tests.multirank.rank import run, spread

STEPS = 80
BATCH = 32  # per rank


def train(communication: str, topo: hvdx.Topology, data) -> dict:
    """Fresh model and optimizer, seeded by rank, broadcast from rank 0, STEPS steps on this
    rank's shard: the loss of the first and last tenth of the steps, the test accuracy, and
    how far the ranks' variables are apart before the broadcast and after training."""
    x_train, x_test, y_train, y_test = data
    keras.utils.set_random_seed(topo.rank)  # different initial weights on every rank
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    optimizer.build(model.trainable_variables)
    before = spread([v.numpy() for v in model.variables], f"{communication}.before")
    hvdx.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    options = {"density": 0.1} if communication == "hitopk" else {}

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvdx.DistributedGradientTape(tape, communication=communication, **options)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x, y = x_train[topo.rank::topo.size], y_train[topo.rank::topo.size]
    losses = []
    for s in range(STEPS):
        at = (s * BATCH) % (len(x) - BATCH)
        losses.append(float(step(x[at:at + BATCH], y[at:at + BATCH])))
    tenth = STEPS // 10
    accuracy = float(np.mean(np.argmax(model(x_test).numpy(), axis=1) == y_test))
    return {"first_loss": float(np.mean(losses[:tenth])), "last_loss": float(np.mean(losses[-tenth:])),
            "accuracy": accuracy, "spread_before": before,
            "spread_after": spread([v.numpy() for v in model.variables + optimizer.variables], communication)}


def entry_points() -> dict:
    """What hvdx's Keras entry points give under Keras 3 as tf.keras: {name: what, or the error}."""
    out = {}
    for name, use in [("DistributedOptimizer", lambda: type(hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))).__module__),
                      ("keras", lambda: hvdx.keras.DistributedOptimizer is hvdx.DistributedOptimizer),
                      ("load_model", lambda: callable(hvdx.load_model))]:
        try:
            out[name] = str(use())
        except Exception as error:  # noqa: BLE001 - reported, the test names it
            out[name] = f"{type(error).__name__}: {error}"
    return out


def main(communications) -> dict:
    topo = hvdx.init()
    data = digits.split()
    return {"keras": keras.__version__, "tf_keras_package": legacy_keras.keras_package(tf), "size": hvd.size(),
            "num_nodes": topo.num_nodes, "runs": {c: train(c, topo, data) for c in communications},
            "entry_points": entry_points()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("communications", nargs="+")
    run(lambda: main(parser.parse_args().communications))
