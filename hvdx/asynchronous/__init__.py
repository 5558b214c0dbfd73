"""Shared-memory asynchronous SGD: one model per node in a /dev/shm segment, updated by the
node's processes without waiting for each other; nodes averaged periodically.

- `AsyncMiniBatch`: Gimpel, Das, Smith, "Distributed Asynchronous Online Learning for Natural
  Language Processing", CoNLL 2010, Algorithm 1 (minibatch.py).
- `ASSM`, `PASSM`, `PASSMPlus`: Kungurtsev, Egan, Chatterjee, Alistarh, "Asynchronous
  Optimization Methods for Efficient Training of Deep Neural Networks with Guarantees",
  AAAI 2021, arXiv 1905.11845 (passm.py; the layer partition and restricted backpropagation:
  partition.py).
- the segment (shared.py); staleness (staleness.py); the step common to all, an
  `hvdx.lifecycle.TrainingMethod` (method.py). In `Model.fit`:
  `hvdx.callbacks.TrainingMethodCallback(method)`, or `SharedModelCallback(method)` (keras.py,
  reached here without importing Keras' callbacks until asked for). Guide: docs/asynchronous.md.

    method = hvdx.asynchronous.ASSM().start(model, optimizer)     # custom loop
    for x, y in shard:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        method.apply_gradients(tape.gradient(loss, method.variables_to_train()))
    method.finish()
"""
from hvdx.asynchronous.method import SharedModelMethod
from hvdx.asynchronous.minibatch import AsyncMiniBatch
from hvdx.asynchronous.partition import backprop_flops_saved, layer_units, partition
from hvdx.asynchronous.passm import ASSM, PASSM, PASSMPlus
from hvdx.asynchronous.shared import SharedModel, SharedModelError, sweep
from hvdx.asynchronous.staleness import Staleness

METHODS = {"asyncminibatch": AsyncMiniBatch, "assm": ASSM, "passm": PASSM, "passm+": PASSMPlus}

__all__ = ["ASSM", "AsyncMiniBatch", "METHODS", "PASSM", "PASSMPlus", "SharedModel", "SharedModelCallback",
           "SharedModelError", "SharedModelMethod", "Staleness", "backprop_flops_saved",
           "layer_units", "partition", "sweep"]


def __getattr__(name: str):
    if name == "SharedModelCallback":  # its Keras glue (hvdx.asynchronous.keras), imported when asked for
        from hvdx.asynchronous.keras import SharedModelCallback
        return SharedModelCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
