"""LocalSGD (hvdx/localsgd.py: DiLoCo's outer optimizer over local SGD) on every rank of an
m x n Horovod job. Run by tests/test_localsgd.py through the suite (tests/multirank/suite.py):
`CHECKS` below, each returning what the test asserts on.
"""
import numpy as np
import tensorflow as tf

from hvdx.callbacks import TrainingMethodCallback
from hvdx.localsgd import LocalSGD
from tests.multirank import digits
from tests.multirank.rank import spread

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def check_averaging(topo):
    """Outer SGD(1.0) without momentum: a synchronisation is the plain average of the ranks'
    models (Lin et al.'s periodic averaging); start() gave every rank rank 0's values first."""
    var = tf.Variable(np.full(6, 10.0 * (topo.rank + 1), np.float32))
    method = LocalSGD(sync_every=1, outer_optimizer=tf.keras.optimizers.SGD(1.0)).start([var])
    started = var.numpy().tolist()
    var.assign(np.arange(6, dtype=np.float32) * (topo.rank + 1))  # this rank's "local step"
    method.after_step()                                          # sync_every=1: the average, at once
    return {"started": started, "averaged": var.numpy().tolist(), "size": topo.size}


def check_fit(topo, epochs=6, batch=16):
    """The digits MLP in Model.fit, driven by the one callback: every rank its own shard and
    its own initial weights (start() takes rank 0's), 8 local steps between synchronisations
    with DiLoCo's outer Nesterov SGD. 6 epochs: 0.93 test accuracy on 2x2 when measured;
    the test asks for 0.8."""
    x_train, x_test, y_train, y_test = digits.split()
    shard = slice(topo.rank, len(x_train) - len(x_train) % topo.size, topo.size)
    model = digits.mlp(seed=topo.rank)
    model.compile(tf.keras.optimizers.SGD(0.05, momentum=0.9), LOSS, metrics=["accuracy"])
    driver = TrainingMethodCallback(LocalSGD(sync_every=8))
    tf.keras.utils.set_random_seed(1 + topo.rank)
    history = model.fit(x_train[shard], y_train[shard], batch_size=batch, epochs=epochs, verbose=0,
                        callbacks=[driver])
    accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
    return {"accuracy": accuracy, "spread": spread(model.get_weights(), "fit"), "loss": history.history["loss"],
            "stats": driver.stats,
            "steps_per_epoch": -(-len(x_train[shard]) // batch), "epochs": epochs}


CHECKS = {"averaging": check_averaging, "fit": check_fit}
