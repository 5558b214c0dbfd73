"""hvdx.DASO: Distributed Asynchronous and Selective Optimization (coquelin2021), and its
Keras 2 optimizer (a Keras 3 optimizer given to `hvdx.DASO` makes
`hvdx.daso.keras3_optimizer.DASO`, the same method on Keras 3).

    hvdx.init()
    opt = hvdx.DASO(tf.keras.optimizers.SGD(0.1, momentum=0.9), total_epochs=20,
                    warmup_epochs=2, cooldown_epochs=2, max_global_skips=4)
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, epochs=20, callbacks=[hvdx.daso.DASOCallback()])
    # or callbacks=[hvdx.callbacks.TrainingMethodCallback()]: DASO is an hvdx.lifecycle.TrainingMethod

A custom loop calls `opt.after_step()` after each step's apply_gradients (outside the
tf.function) and `opt.end_epoch(loss)` after each epoch:

    for epoch in range(20):
        for x, y in data:
            loss = train_step(x, y)       # tape, opt.apply_gradients(...)
            opt.after_step()
        opt.end_epoch(epoch_loss)         # drains, feeds the loss to the schedule

Every step, the gradients are averaged inside the node (hvdx.DistributedOptimizer over
the node-local process set) and applied by the wrapped optimizer; then the schedule
(hvdx.daso.schedule) says whether the parameters are averaged globally now (blocking),
start to be (non-blocking) or a stale average is merged (eq. 1), and
hvdx.daso.sync does it over hvdx's own transport (hvdx.transport.ring). Internals and
guarantees: docs/daso.md. What both Keras share: hvdx.daso.method.

Raises RuntimeError without hvdx.init(), ValueError for bad arguments (naming them), for
an optimizer already wrapped for data parallelism (hvdx's or Horovod's DistributedOptimizer)
and when a later apply_gradients passes other variables than the first; a second step
without after_step() in between (Model.fit without DASOCallback) fails with
InvalidArgumentError saying so.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import tensorflow as tf

from hvdx.daso.method import DASOMethod, find_daso
from hvdx.optimizer import DistributedOptimizer
from hvdx.wrapper_core import is_keras3_optimizer
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["DASO", "find_daso"]


@keras2.utils.register_keras_serializable(package="hvdx")
class DASO(DASOMethod, DistributedOptimizer):
    """Wraps a Keras optimizer (of either Keras: a Keras 3 one makes the Keras 3 class,
    hvdx.daso.keras3_optimizer.DASO, an instance of hvdx.daso.DASOMethod as this one): node-local gradient averaging every step, global
    parameter averaging in rotating groups, blocking in the first `warmup_epochs` and the
    last `cooldown_epochs`, non-blocking every B steps in between (coquelin2021, sec. 3).
    Also an `hvdx.lifecycle.TrainingMethod` (its hooks are listed under "The lifecycle").

    total_epochs: how long training runs (the cool-down phase is its last epochs).
    max_global_skips: B at the start of the cycling phase (W starts at B/4, at least 1).
    plateau_patience, plateau_threshold: when the epoch's training loss has plateaued
      (hvdx.daso.PlateauDetector): B and W halve, or reset from B = W = 1.
    blocking_wire_dtype: "bfloat16" (the paper), "float16" (scaled) or "float32": what the
      blocking phases send; master weights stay float32 (hvdx.daso.sync).
    timeout: seconds a global exchange may take before the job fails with a message.

    Needs hvdx.init() first. When the step is first traced, every rank takes rank 0's
    parameters (no broadcast callback needed). The global synchronisations run outside the step function:
    Model.fit needs hvdx.daso.DASOCallback (steps_per_execution=1); a custom loop calls
    after_step() and end_epoch(loss). Call drain() on every rank before saving a
    checkpoint mid-epoch (epochs end drained); the schedule's state is saved with the
    optimizer in every checkpoint format and restored from it, also onto another topology
    (the groups are planned again for its ranks per node).

    The lifecycle (`hvdx.lifecycle.TrainingMethod`, driven by
    `hvdx.callbacks.TrainingMethodCallback` / `DASOCallback`): `start()` is lazy where the
    variables are not known yet (they are those of the first traced apply_gradients, which
    broadcasts rank 0's parameters; the first `after_step()` then builds the transport,
    collectively), and rebuilds collectively after `reset()`; `begin_epoch(epoch)` is
    `start_epoch`; `after_step()`; `end_epoch(epoch, logs)` drains and feeds logs["loss"] to
    the schedule; `finish()` drains; `close()`; `state()` / `restore()` the schedule;
    `reset(topology)`; `stats()` (`stats` is also the `SyncStats` itself).
    """

    _keras3_counterpart = "hvdx.daso.keras3_optimizer:DASO"

    def __new__(cls, optimizer=None, *args, **kwargs):
        if is_keras3_optimizer(optimizer) and vars(cls).get("_hvdx_wrapper", cls) is DASO:
            # A Keras 3 optimizer makes the Keras 3 class (not an instance of this one: Python
            # does not __init__ it again)
            from hvdx.daso import keras3_optimizer

            return keras3_optimizer.DASO(optimizer, *args, **kwargs)
        return super().__new__(cls, optimizer, *args, **kwargs)

    def __init__(self, optimizer, total_epochs: int, warmup_epochs: int = 1, cooldown_epochs: int = 1,
                 max_global_skips: int = 4, *, plateau_patience: int = 2, plateau_threshold: float = 0.05,
                 blocking_wire_dtype: str = "bfloat16", timeout: float = 300.0, name: Optional[str] = None,
                 schedule_state: Optional[Dict[str, Any]] = None) -> None:
        self._construct(DistributedOptimizer, optimizer, total_epochs, warmup_epochs, cooldown_epochs,
                        max_global_skips, name=name, plateau_patience=plateau_patience,
                        plateau_threshold=plateau_threshold, blocking_wire_dtype=blocking_wire_dtype, timeout=timeout,
                        schedule_state=schedule_state)

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation: bool = False, **kwargs):
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        return self._guarded_step([v for _, v in grads_and_vars], lambda: DistributedOptimizer.apply_gradients(
            self, grads_and_vars, name, skip_gradients_aggregation, **kwargs))

    # -- saving ------------------------------------------------------------------------
    def save_own_variables(self, store):
        DistributedOptimizer.save_own_variables(self, store)
        self._save_schedule(store)

    def load_own_variables(self, store):
        DistributedOptimizer.load_own_variables(self, self._load_schedule(store))

    def get_config(self):
        return {"optimizer": keras2.optimizers.serialize(self._optimizer), "name": self.name, **self._method_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        counterpart = cls._from_config_class(config)  # a Keras 3 DASO's config
        if counterpart is not None:
            return counterpart.from_config(config, custom_objects=custom_objects)
        config = dict(config)
        optimizer = keras2.optimizers.deserialize(config.pop("optimizer"), custom_objects=custom_objects)
        return cls(optimizer, **config)
