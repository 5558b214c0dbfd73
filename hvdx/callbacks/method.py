"""One Keras callback drives every training method (`hvdx.lifecycle.TrainingMethod`): DASO,
AD-PSGD, the shared-memory family, LocalSGD, and any new one.

    model.compile(optimizer=hvdx.DASO(tf.keras.optimizers.SGD(0.1), total_epochs=20), loss=...)
    model.fit(..., callbacks=[hvdx.callbacks.TrainingMethodCallback()])           # found in the optimizer
    model.fit(..., callbacks=[hvdx.callbacks.TrainingMethodCallback(hvdx.asynchronous.ASSM())])
    model.fit(..., callbacks=[hvdx.callbacks.TrainingMethodCallback(hvdx.localsgd.LocalSGD(sync_every=8))])

What the callback does, in `fit`'s order (the protocol: hvdx/lifecycle.py):

- train begin: steps_per_execution must be 1 where the method acts after every step
  (`needs_every_step`); every rank must run as many steps and epochs where the method
  counts them (`same_steps_on_every_rank`: `check_same_steps`, collective); then
  `start(model, model.optimizer, steps_per_epoch=, epochs=)` (collective), and the method's
  `train_step` in place of the model's where `replaces_train_step`;
- epoch begin: `begin_epoch(epoch)`, a new trace of the step function when it says so;
- batch end: `after_step()`; after the epoch's LAST batch (Keras' `steps`) `end_epoch(epoch,
  logs)`, so that every rank holds the method's model before validation and before other
  callbacks' on_epoch_end (ModelCheckpoint); where the steps are unknown, at epoch end (not
  when training was stopped in the middle of the epoch); then `should_stop()` ->
  `model.stop_training`;
- test begin (fit's validation): `before_evaluation()`;
- train end: `finish()` (collective), `close()`, the model's own `train_step` back, `stats`.

Any hook that raises closes the method (`close()`: no collective) before the error goes on,
so a failed `fit` leaves no sockets, threads or shared memory. The driver knows no particular
method: a method's own Keras glue, where it has any, is a subclass in the method's package
(`hvdx.daso.DASOCallback`, `hvdx.adpsgd.ADPSGDCallback` (a new ADPSGD per `fit`),
`hvdx.asynchronous.SharedModelCallback`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Type

from hvdx.callbacks.broadcast import check_same_steps
from hvdx.lifecycle import TrainingMethod, find_method, running, stopped
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["TrainingMethodCallback"]


class TrainingMethodCallback(keras2.callbacks.Callback):
    """Drives `method` during `Model.fit` (module docstring); None: the `TrainingMethod` the
    model's optimizer is or wraps (e.g. hvdx.DASO under a LossScaleOptimizer), found at train
    begin and kept for later fits.

    `method` is the method driven (after train begin); `stats` its `stats()` after `fit`.

    Raises (from `fit`): ValueError without a method, or with steps_per_execution > 1 where
    the method acts after every step; RankMismatchError where ranks run different steps;
    TypeError for a `method` that is no `TrainingMethod`.
    """

    #: what `method=None` looks for along the model's optimizers
    kind: Type[TrainingMethod] = TrainingMethod

    def __init__(self, method: Optional[TrainingMethod] = None) -> None:
        super().__init__()
        if method is not None and not isinstance(method, self.kind):
            raise TypeError(f"{type(self).__name__} drives an hvdx.lifecycle.TrainingMethod (hvdx.DASO, "
                            f"hvdx.adpsgd.ADPSGD, hvdx.asynchronous.ASSM(), hvdx.localsgd.LocalSGD(), ...), got "
                            f"{type(method).__name__}")
        self.method = method
        self.stats: Dict[str, Any] = {}
        self._steps: Optional[int] = None
        self._running = False
        self._epoch = 0
        self._epoch_ended = False
        self._cut = False  # training was stopped in the middle of the epoch

    # -- what a subclass may change ------------------------------------------------------------
    def _method_for_fit(self) -> TrainingMethod:
        """The method this fit drives: the given one, else the one found in the model's optimizer."""
        method = self.method if self.method is not None else find_method(self.model.optimizer, self.kind)
        if method is None:
            raise ValueError(self._missing())
        return method

    def _missing(self) -> str:
        return (f"{type(self).__name__}() without a method needs a model compiled with an optimizer that is an "
                f"hvdx.lifecycle.TrainingMethod (hvdx.DASO(...)); else pass the method: "
                f"{type(self).__name__}(hvdx.asynchronous.ASSM())")

    # -- fit's events ------------------------------------------------------------------------
    def on_train_begin(self, logs=None) -> None:
        method = self.method = self._method_for_fit()
        model = self.model
        if method.needs_every_step and _steps_per_execution(model) != 1:
            raise ValueError(f"{method.label} acts between steps: compile the model with steps_per_execution=1")
        params = self.params or {}
        if method.same_steps_on_every_rank:
            check_same_steps(params, name="hvdx.lifecycle.steps")
        self._steps = params.get("steps")
        self._call(method.start, model, model.optimizer, steps_per_epoch=self._steps, epochs=params.get("epochs"))
        self._running = True
        running(method)  # a membership change (hvdx.elastic) resets it
        if method.replaces_train_step:
            model.train_step = self._train_step
            model.make_train_function(force=True)  # both Keras keep it as model.train_function

    def _train_step(self, data):
        return self.method.train_step(self.model, data)

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        self._epoch, self._epoch_ended, self._cut = epoch, False, False
        if self._call(self.method.begin_epoch, epoch):  # e.g. PASSM+ changed phase: trace the other step
            self.model.make_train_function(force=True)

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        self._call(self.method.after_step)
        if self._steps is not None and batch + 1 == self._steps:
            self._end_epoch(logs)
        if self._call(self.method.should_stop):
            self.model.stop_training = True
        self._cut = bool(self.model.stop_training) and not self._epoch_ended

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        if not self._epoch_ended and not self._cut:  # steps per epoch unknown (a dataset of unknown length)
            self._end_epoch(logs)

    def on_test_begin(self, logs=None) -> None:
        if self._running:  # fit's validation (evaluate() outside fit is not the method's business)
            self._call(self.method.before_evaluation)

    def on_train_end(self, logs=None) -> None:
        if not self._running:
            return
        self._running = False
        method, model = self.method, self.model
        try:
            method.finish()
        except BaseException:
            method.close()
            stopped(method)
            raise
        finally:
            if "train_step" in vars(model):
                del model.train_step
                model.train_function = None
        method.close()
        stopped(method)
        self.stats = method.stats()

    # -- helpers -------------------------------------------------------------------------------
    def _end_epoch(self, logs) -> None:
        self._call(self.method.end_epoch, self._epoch, dict(logs or {}))
        self._epoch_ended = True

    def _call(self, hook: Callable[..., Any], *args, **kwargs) -> Any:
        """`hook(...)`; on any error the method is closed (no collective) and the model's own
        train step put back, then the error goes on."""
        try:
            return hook(*args, **kwargs)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        self._running = False
        try:
            if self.method is not None:
                self.method.close()
                stopped(self.method)
        finally:
            model = self.model
            if model is not None and "train_step" in vars(model):
                del model.train_step
                model.train_function = None


def _steps_per_execution(model: Any) -> int:
    """The steps one call of the model's train function runs: Keras 2's `_steps_per_execution`
    (a variable), Keras 3's `steps_per_execution` (an int); 1 where neither is set."""
    value = getattr(model, "_steps_per_execution", None)
    if value is None:
        value = getattr(model, "steps_per_execution", None)
    if value is None:
        return 1
    return int(value.numpy()) if hasattr(value, "numpy") else int(value)
