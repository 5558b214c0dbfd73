"""The shared-memory asynchronous methods in `Model.fit`: `SharedModelCallback`.

    method = hvdx.asynchronous.PASSMPlus(full_epochs=PASSMPlus.paper_schedule(20, decays=[10, 15]))
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9), loss=...)
    model.fit(x_shard, y_shard, epochs=20, callbacks=[hvdx.asynchronous.SharedModelCallback(method)])

The optimizer is the plain Keras one (no DistributedOptimizer: the shared model replaces
gradient averaging). Each rank trains on its own shard. The callback replaces the model's
train step for the duration of `fit` with one that differentiates `variables_to_train()`
only (PASSM's restricted backpropagation), applies the optimizer to them, adds the update to
the node's shared model and reads it back, all inside the traced step.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import tensorflow as tf

from hvdx.asynchronous.method import SharedModelMethod

__all__ = ["SharedModelCallback"]


class SharedModelCallback(tf.keras.callbacks.Callback):
    """Runs `method` during `fit` (module docstring).

    Each step reads the node's shared model at its start (AsyncMiniBatch: takes it from its
    last update's read-back). At every epoch's end the model's variables hold its node's
    shared model, so callbacks placed after this one (ModelCheckpoint) save the shared
    model; at the end of `fit` every rank holds the final model (identical on every rank:
    `finish()`). `stats` holds this rank's record (steps, staleness) after `fit`.
    Every rank must run the same number of epochs (equal shards).
    """

    def __init__(self, method: SharedModelMethod) -> None:
        super().__init__()
        if not isinstance(method, SharedModelMethod):
            raise TypeError(f"SharedModelCallback takes an hvdx.asynchronous method (AsyncMiniBatch, ASSM, PASSM, "
                            f"PASSMPlus), got {type(method).__name__}")
        self.method = method
        self.stats: Dict[str, Any] = {}

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        model = self.model
        self.method.start(model, model.optimizer)
        self.method.set_epoch(0)
        model.train_step = self._train_step
        model.train_function = model.make_train_function(force=True)

    def _train_step(self, data):
        model, method = self.model, self.method
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        method.step_begin_ops()              # read the shared model now: the freshest x
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x, y, y_pred, sample_weight)
        own = method.variables_to_train()
        grads = tape.gradient(loss, own)     # PASSM: restricted backpropagation
        model.optimizer.apply_gradients(zip(grads, own))
        method.push_ops(read_after=False)
        return model.compute_metrics(x, y, y_pred, sample_weight)

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.method.set_epoch(epoch):     # PASSM+ changed phase: trace the other step
            self.model.train_function = self.model.make_train_function(force=True)

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.method.after_step()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.method.pull()                   # callbacks after this one (checkpoints) see the shared model

    def on_test_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.method.shared is not None:   # fit's validation evaluates the shared model
            self.method.pull()

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        model = self.model
        try:
            self.method.finish()
        except BaseException:
            self.method.close()
            raise
        finally:
            if "train_step" in vars(model):
                del model.train_step
            model.train_function = None
        self.stats = self.method.stats()
