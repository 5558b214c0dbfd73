"""Horovod's TF2 Keras elastic example on scikit-learn's digits, run by tests/test_elastic.py
under `horovodrun --gloo --min-np 2 --max-np 4 --host-discovery-script`.

    elastic_digits.py API COMMUNICATION HOSTS_FILE [EPOCHS [SCHEDULE]]

API: "horovod" (`import horovod.tensorflow.keras as hvd`) or "hvdx" (`import hvdx.keras as
hvd`, with `communication=COMMUNICATION`; COMMUNICATION "daso", "adpsgd" or "assm": that
training method instead, driven by `hvdx.callbacks.TrainingMethodCallback`). HOSTS_FILE is what the discovery script prints:
rank 0 writes "127.0.0.1:2" into it at the end of epoch 1 (node localhost removed) and, with
SCHEDULE "remove,add" (the default; "remove": only the removal), both hosts again at the end
of epoch 3 (the node back); SCHEDULE "shrink": localhost keeps one of its two ranks at the end
of epoch 1 (nodes of 2 and 1 ranks: hvdx runs flat, `hvdx.init(uneven_nodes=)`); "kill": rank 3
SIGKILLs itself at the end of epoch 1 (a preempted process; the host list stays); "horovod": Horovod's
own elastic example's pattern (examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py):
Adam at 0.001 x size, a one-step `fit` at module level before `hvd.elastic.run` (a new worker's
first collectives) and another in the state's reset callback (the survivors'); "keras3" (with
API "hvdx", launched without $TF_USE_LEGACY_KERAS: tf.keras is Keras 3 too): the Keras 3 form,
a model of `import keras` seeded apart on every rank (the state's first sync makes them one),
`hvd.DistributedOptimizer` of a Keras 3 optimizer (hvdx's Keras 3 wrapper; with a method as
COMMUNICATION, the plain Keras 3 optimizer and the method's driver), hvd.callbacks'
MetricAverageCallback and the elastic callbacks in its `fit`, the Keras 3 elastic state. With
the synchronous wrapper every rank sends rank 0 its residuals' owners, norm and step counters at
the end (rank 0 records them: `residuals`). Every rank prints
`ELASTIC size=S checksum_spread=X` at every `fit` start (after Horovod's sync: the weights'
largest difference between ranks) and rank 0 writes its record (sizes seen, spreads, final
accuracy, when it was told of each host change) to $HVDX_RESULT_DIR/elastic.json and every
process when it called `hvd.init` and whether Horovod started it ahead of its reset (patch 0004)
to $HVDX_RESULT_DIR/process-<pid>.json. With $HVDX_ELASTIC_DATACACHE (a folder tree of
8 px grayscale digits) the ranks read their batches from an `hvdx.data.DataCache` over it
(node stores under $HVDX_RESULT_DIR/shm; a reset splits it again) and every rank writes the
files it read from the source to $HVDX_RESULT_DIR/reads-<pid>.json.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hvdx  # noqa: E402 - imports no TensorFlow: tf.keras is what $TF_USE_LEGACY_KERAS makes it
import hvdx.legacy_keras  # noqa: E402

import numpy as np  # noqa: E402

API, COMMUNICATION, HOSTS_FILE = sys.argv[1:4]
EPOCHS = int(sys.argv[4]) if len(sys.argv) > 4 else 8
SCHEDULE = sys.argv[5].split(",") if len(sys.argv) > 5 else ["remove", "add"]
BATCH = 32
STEPS = 12  # per epoch, whatever the size: enough commits for a host change to be seen
HOST_NOTICE_WAIT = 120.0  # at most, seconds rank 0 waits for the driver's notice of a host change
RESULTS = Path(os.environ.get("HVDX_RESULT_DIR", "/tmp"))
KERAS3 = "keras3" in SCHEDULE  # the Keras 3 form (API "hvdx")

if API == "hvdx":
    import hvdx.keras as hvd
else:
    import horovod.tensorflow.keras as hvd
import tensorflow as tf  # noqa: E402

if KERAS3:
    import keras  # noqa: E402

from tests.multirank import digits  # noqa: E402
from tests.multirank.rank import spread  # noqa: E402

BEFORE_INIT = time.time()  # an added host's processes reach here before the survivors are told (patch 0004)
hvd.init()
x_train, x_test, y_train, y_test = digits.split()
DATACACHE = os.environ.get("HVDX_ELASTIC_DATACACHE")
if DATACACHE:  # made once per process, before the training function: a reset splits it again
    from hvdx.data import CountingSource, DataCache

    source = CountingSource()
    host = os.environ.get("HOROVOD_HOSTNAME", "node")  # level 1 is node-local, as on a cluster
    cache = DataCache(DATACACHE, resolution=8, channels=1, cache_dir=str(RESULTS / f"disk-{host}"),
                      store_dir=str(RESULTS / "shm"), memory_bytes=2**26, source=source)
HOROVOD_PATTERN = "horovod" in SCHEDULE
LEARNING_RATE = 0.001 if HOROVOD_PATTERN else 0.05
if KERAS3:
    keras.utils.set_random_seed(hvd.rank())  # apart: the state's sync at the run's start makes them one
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    optimizers, losses, Callback = keras.optimizers, keras.losses, keras.callbacks.Callback
else:
    model = digits.mlp(seed=0)
    optimizers, losses, Callback = tf.keras.optimizers, tf.keras.losses, tf.keras.callbacks.Callback
if HOROVOD_PATTERN:  # an adaptive optimizer: the sparse strategies' density warm-up (their step counters)
    optimizer = optimizers.Adam(LEARNING_RATE * hvd.size())
else:
    optimizer = optimizers.SGD(LEARNING_RATE * hvd.size(), momentum=0.9)
method_callbacks = []
if API == "hvdx" and COMMUNICATION in ("daso", "adpsgd", "assm"):
    from hvdx.adpsgd import ADPSGD
    from hvdx.asynchronous import ASSM
    from hvdx.callbacks import TrainingMethodCallback

    if COMMUNICATION == "daso":
        optimizer = hvdx.DASO(optimizer, total_epochs=EPOCHS)
        method_callbacks = [TrainingMethodCallback()]
    else:
        method = ADPSGD(topology="ring", timeout=60) if COMMUNICATION == "adpsgd" else ASSM(average_every=4)
        method_callbacks = [TrainingMethodCallback(method)]
elif API == "hvdx":
    optimizer = hvd.DistributedOptimizer(optimizer, communication=COMMUNICATION)
else:
    optimizer = hvd.DistributedOptimizer(optimizer)
model.compile(optimizer=optimizer, loss=losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
model.build((None, 64))
record = {"sizes": [], "spreads": [], "tf_keras_is_keras3": hvdx.legacy_keras.tf_keras_is_keras3()}
no_autotune = tf.data.Options()
no_autotune.autotune.enabled = False  # deleting the one-step fit's iterator can wait out its sleep (docs/elastic.md)
one_step = tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat().batch(BATCH).with_options(no_autotune)
if HOROVOD_PATTERN:  # Horovod's example: "initialize optimizer state so we can synchronize across workers"
    model.fit(one_step, steps_per_epoch=1, epochs=1, verbose=0)


class Check(Callback):
    """At each fit start (after the state's sync): every rank's weights are the same; rank 0
    changes the discovery script's host list at the end of epochs 1 and 3."""

    def on_train_begin(self, logs=None):
        s = spread(self.model.get_weights(), f"elastic.{len(record['sizes'])}")
        record["sizes"].append(hvd.size())
        record["spreads"].append(s)
        print(f"ELASTIC rank={hvd.rank()} size={hvd.size()} checksum_spread={s}", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        if "kill" in SCHEDULE and state.epoch == 1 and hvd.size() == 4 and hvd.rank() == 3:
            print(f"ELASTIC rank={hvd.rank()} kills itself (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if hvd.rank() != 0:
            return
        epoch = state.epoch  # fit's epochs count from this fit's start; the state's from the run's
        changes = {1: [("remove", "127.0.0.1:2\n"), ("shrink", "127.0.0.1:2\nlocalhost:1\n")],
                   3: [("add", "127.0.0.1:2\nlocalhost:2\n")]}
        change, hosts = next(((c, h) for c, h in changes.get(epoch, []) if c in SCHEDULE), (None, None))
        if change is None:
            return
        if hosts is not None and epoch not in record.setdefault("changed", []):
            record["changed"].append(epoch)
            if Path(HOSTS_FILE).read_text() == hosts:
                # made by the rank 0 of a node that left: this process, rank 0 since the reset, took
                # the restored epoch's end again; no notice is coming (it waited out HOST_NOTICE_WAIT)
                return
            Path(HOSTS_FILE).write_text(hosts)
            # Horovod's driver polls the discovery script about once a second and tells rank 0
            # (of an added host once its new processes wait in their first init: Horovod patch
            # 0004); the ranks see the notice at their next commit. Without this wait a fast job
            # could end before it. The other ranks wait in the next step's collective meanwhile
            # (Horovod's background threads keep talking: no collective times out).
            deadline = time.monotonic() + HOST_NOTICE_WAIT
            while state._host_messages.empty() and time.monotonic() < deadline:  # Horovod's State
                time.sleep(0.2)
            record.setdefault("notices", []).append(time.time())


state = hvd.elastic.KerasState(model, batch=0, epoch=0)
record["state"] = [c.__name__ for c in type(state).__mro__[:2]]  # the Keras 3 state: ["KerasState", "Keras3State"]


def on_state_reset():
    if KERAS3:
        state.model.optimizer.learning_rate = LEARNING_RATE * hvd.size()
    else:
        tf.keras.backend.set_value(state.model.optimizer.learning_rate, LEARNING_RATE * hvd.size())
    if HOROVOD_PATTERN:  # Horovod's example: "re-initialize, to join with possible new ranks"
        state.model.fit(one_step, steps_per_epoch=1, epochs=1, verbose=0)


state.register_reset_callbacks([on_state_reset])
# the method's callback first: its start (one model on every rank) before Check's look at the weights
callbacks = method_callbacks + ([hvd.callbacks.MetricAverageCallback()] if KERAS3 else []) + [
    Check(), hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.UpdateEpochStateCallback(state)]
rng = np.random.default_rng(0)


@hvd.elastic.run
def train(state):
    if DATACACHE:  # made after every reset: the split of that membership
        data = cache.dataset(BATCH, epochs=None, first_epoch=state.epoch).map(
            lambda x, y: (tf.reshape(tf.cast(x, tf.float32) / 255.0, [-1, 64]), y))
    else:
        shard = rng.permutation(len(x_train))
        data = tf.data.Dataset.from_tensor_slices((x_train[shard], y_train[shard])).repeat().shuffle(
            512, seed=hvd.rank()).batch(BATCH).with_options(no_autotune)
    model.fit(data, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch, callbacks=callbacks,
              verbose=0)


train(state)
_, accuracy = model.evaluate(x_test, y_test, verbose=0)
final = spread(model.get_weights(), "elastic.final")
if API == "hvdx" and not method_callbacks:  # the synchronous wrapper: each rank's residuals, as the last steps left them
    from hvdx.wrapper_core import residual_state

    residuals = residual_state(model.optimizer.aggregator)
    mine = {"rank": hvd.rank(), "owners": sorted({tuple(int(i) for i in v) for k, v in residuals.items()
                                                  if k.endswith(".owner")}),
            "norm": float(np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64)))
                                      for k, v in residuals.items() if k.endswith(".residual")))),
            "steps": {k: int(v) for k, v in residuals.items() if k.endswith(".step")}}
    record["residuals"] = hvd.allgather_object(mine, name="elastic.residuals")
print(f"ELASTIC_DONE rank={hvd.rank()} size={hvd.size()} accuracy={accuracy:.4f} checksum_spread={final}",
      flush=True)
if DATACACHE:
    (RESULTS / f"reads-{os.getpid()}.json").write_text(json.dumps({
        "host": host, "sizes": record["sizes"], "reads": source.reads,
        "store": cache.store.path, "part": len(cache.part)}))
(RESULTS / f"process-{os.getpid()}.json").write_text(json.dumps({
    "before_init": BEFORE_INIT, "prelaunched": os.environ.get("HOROVOD_ELASTIC_PRELAUNCHED") == "1"}))
if hvd.rank() == 0:
    record.update(accuracy=float(accuracy), final_spread=final, size=hvd.size())
    out = RESULTS / "elastic.json"
    out.write_text(json.dumps(record))
