"""Horovod habits through hvdx on several ranks (tests/test_horovod_api.py runs it in the
2 nodes x 1 rank launch), each rank with its own data (`linear_data(rank)`):

- a tf.compat.v1.train optimizer wrapped by hvdx.tensorflow.DistributedOptimizer, trained in
  a tf.compat.v1 graph + session and eagerly: the weights after each step;
- Horovod's own LearningRateWarmupCallback (imported from horovod) with momentum correction
  on an hvdx-wrapped new-style SGD, in model.fit: the learning rate and momentum each batch
  ran with (as the callbacks left them) and the final weights; and its MetricAverageCallback:
  each epoch's loss before and after it. From TensorFlow 2.16 on, where Horovod hands these
  callbacks Keras 3's backend and they fail, hvdx.keras.horovod_callbacks' (the same classes
  on tf.keras's backend).

Every rank returns its results; the test compares them across ranks and with a NumPy
reference of averaged gradients.
"""
from typing import Dict, List

import numpy as np

FEATURES = 3
SAMPLES = 32
BATCH = 8
V1_STEPS = 4


def linear_data(rank: int):
    """(x, y) of this rank: a noisy linear function, different on every rank."""
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.3 + 0.1 * rng.standard_normal(SAMPLES)).astype(np.float32)
    return x, y.reshape(-1, 1)


def v1_graph(rank: int) -> List[List[float]]:
    import tensorflow as tf

    import hvdx.tensorflow as hvd

    x, y = linear_data(rank)
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.zeros((FEATURES, 1)))
        b = tf.compat.v1.get_variable("b", initializer=tf.zeros((1,)))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.05, 0.9))
        train = opt.minimize(loss, global_step=step)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            out = []
            for _ in range(V1_STEPS):
                session.run(train)
                out.append(np.concatenate([session.run(w).ravel(), session.run(b)]).tolist())
            assert session.run(step) == V1_STEPS
    return out


def v1_eager(rank: int) -> List[List[float]]:
    import tensorflow as tf

    import hvdx.tensorflow as hvd

    x, y = linear_data(rank)
    w, b = tf.Variable(tf.zeros((FEATURES, 1))), tf.Variable(tf.zeros((1,)))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05), communication="allreduce")
    out = []
    for _ in range(V1_STEPS):
        opt.minimize(lambda: tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y)), var_list=[w, b])
        out.append(np.concatenate([w.numpy().ravel(), b.numpy()]).tolist())
    return out


def backend_callbacks():
    """The module whose MetricAverage / LearningRate* callbacks a Horovod user runs here:
    Horovod's own where they work (TensorFlow < 2.16), hvdx's versions of them otherwise."""
    import horovod.tensorflow.keras.callbacks as horovod_callbacks
    import tensorflow as tf

    import hvdx.keras.horovod_callbacks
    from hvdx import legacy_keras

    keras3_tf = tuple(int(p) for p in tf.__version__.split(".")[:2]) >= legacy_keras.KERAS3_SINCE
    return hvdx.keras.horovod_callbacks if keras3_tf else horovod_callbacks


def lr_warmup(rank: int) -> Dict[str, list]:
    import tensorflow as tf

    import hvdx.keras as hvd

    x, y = linear_data(rank)
    model = tf.keras.Sequential([tf.keras.layers.Input((FEATURES,)),
                                 tf.keras.layers.Dense(1, kernel_initializer="zeros")])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9))
    assert isinstance(opt, tf.keras.optimizers.SGD)
    model.compile(opt, "mse")
    seen: Dict[str, list] = {"lr": [], "momentum": [], "loss_own": [], "loss_averaged": []}

    class Record(tf.keras.callbacks.Callback):
        def __init__(self, loss: str) -> None:
            super().__init__()
            self.loss = loss

        def on_train_batch_begin(self, batch, logs=None):  # after the warm-up callback's
            if self.loss == "loss_averaged":
                seen["lr"].append(float(tf.keras.backend.get_value(self.model.optimizer.lr)))
                seen["momentum"].append(float(tf.keras.backend.get_value(self.model.optimizer.momentum)))

        def on_epoch_end(self, epoch, logs=None):  # before and after MetricAverageCallback's
            seen[self.loss].append(float(logs["loss"]))

    callbacks = backend_callbacks()
    warmup = callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=2, momentum_correction=True)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), warmup, Record("loss_own"),
                         callbacks.MetricAverageCallback(), Record("loss_averaged")])
    seen["weights"] = np.concatenate([v.numpy().ravel() for v in model.trainable_variables]).tolist()
    seen["momentum_after"] = float(opt.momentum.numpy())
    return seen


def check_habits(topo) -> dict:
    return {"size": topo.size, "v1_graph": v1_graph(topo.rank), "v1_eager": v1_eager(topo.rank),
            "lr_warmup": lr_warmup(topo.rank)}


CHECKS = {"habits": check_habits}
