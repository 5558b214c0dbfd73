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
so a failed `fit` leaves no sockets, threads or shared memory. The old callbacks are this
one: `DASOCallback(daso=None)`, `ADPSGDCallback(**kwargs)` (a new ADPSGD per `fit`),
`SharedModelCallback(method)`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Type

import tensorflow as tf

from hvdx.adpsgd.graph import Edges, build_graph
from hvdx.adpsgd.method import ADPSGD, check_cross_node_weight, check_fit_options
from hvdx.asynchronous.method import SharedModelMethod
from hvdx.callbacks.broadcast import check_same_steps
from hvdx.daso.optimizer import DASO
from hvdx.lifecycle import TrainingMethod, find_method, running, stopped
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["ADPSGDCallback", "DASOCallback", "SharedModelCallback", "TrainingMethodCallback"]


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
        if method.needs_every_step:
            steps_per_execution = getattr(model, "_steps_per_execution", None)
            if steps_per_execution is not None and int(steps_per_execution.numpy()) != 1:
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
            model.train_function = model.make_train_function(force=True)

    def _train_step(self, data):
        return self.method.train_step(self.model, data)

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        self._epoch, self._epoch_ended, self._cut = epoch, False, False
        if self._call(self.method.begin_epoch, epoch):  # e.g. PASSM+ changed phase: trace the other step
            self.model.train_function = self.model.make_train_function(force=True)

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


# -- the old callbacks: the driver for one kind of method -------------------------------------------
class DASOCallback(TrainingMethodCallback):
    """`TrainingMethodCallback` for the model's hvdx.DASO optimizer (or `daso`, if given): after
    every batch the schedule's global synchronisation (`DASO.after_step`), after the last
    batch of an epoch the drain and the epoch's training loss (`DASO.end_epoch`), at the end
    `DASO.close()`; before the first batch the check that every rank runs as many steps and
    epochs. `daso` is the optimizer driven."""

    kind = DASO

    def __init__(self, daso: Optional[DASO] = None) -> None:
        super().__init__(daso)

    @property
    def daso(self) -> Optional[DASO]:
        return self.method

    def _missing(self) -> str:
        return "DASOCallback needs a model compiled with hvdx.DASO(...) as its optimizer"


class ADPSGDCallback(TrainingMethodCallback):
    """AD-PSGD in `Model.fit`: a new `hvdx.adpsgd.ADPSGD` over the model's float weights per
    `fit`, driven as `TrainingMethodCallback` drives it (they gossip after every batch); in
    an elastic job the fit after a membership change goes on with the reset one (its counts,
    what is left of `global_epochs`).

    Args:
      topology, seed, timeout, finish_timeout, switch_interval, cross_node_weight: as `ADPSGD`.
      global_epochs: training ends when all ranks together ran that many epochs of steps:
        global_epochs x the sum over ranks of their steps per epoch (Keras' `steps`; one
        Horovod allreduce at the start), so fast ranks do the slow ones' share (lian2018's
        epochs). Give `fit` enough epochs for the fastest rank (`global_epochs * hvd.size()`
        always is); each rank cycles its own data.
      max_seconds: this rank stops training after that many seconds of `fit` (at the end of a
        batch; the ranks end at their own times), else the epochs end it.
      average_every_epoch: every rank averages at each epoch's end (a collective: the
        validation and callbacks after this one, e.g. ModelCheckpoint, see the average model;
        needs the same number of epochs on every rank, so not with `max_seconds`).
      name: the prefix of the collectives' names (each fit adds its count, the ranks' largest:
        one Horovod allreduce at the start of every fit).

    At the end of `fit` every rank holds the average model (`Model.evaluate` and
    `Model.save` are then well defined). `adpsgd` is the last fit's ADPSGD, `stats` its
    counts (steps, exchanges). Raises ValueError for an unknown topology and options that
    exclude each other (here, before `fit`).
    """

    kind = ADPSGD

    def __init__(self, *, topology: "str | Callable[[int], Edges]" = "ring", seed: Optional[int] = None,
                 timeout: float = 60.0, finish_timeout: Optional[float] = None,
                 max_seconds: Optional[float] = None, average_every_epoch: bool = False,
                 name: str = "hvdx.adpsgd", global_epochs: Optional[float] = None,
                 switch_interval: Optional[float] = 0.001, cross_node_weight: float = 1.0) -> None:
        super().__init__()
        check_fit_options(max_seconds, average_every_epoch, global_epochs)
        self.global_epochs = global_epochs
        self._kwargs = dict(topology=topology, seed=seed, timeout=timeout, finish_timeout=finish_timeout, name=name,
                            switch_interval=switch_interval,
                            cross_node_weight=check_cross_node_weight(cross_node_weight))
        build_graph(topology, 2)  # an unknown topology fails here, before fit
        self.max_seconds, self.average_every_epoch = max_seconds, average_every_epoch
        self._calls = 0

    @property
    def adpsgd(self) -> Optional[ADPSGD]:
        return self.method

    def _method_for_fit(self) -> ADPSGD:
        """A new ADPSGD, or the last one where a membership change reset it (`hvdx.elastic`:
        it goes on with its counts and what is left of the budget). Collective: the ranks agree
        on the fit's count, which names the collectives, so that a process Elastic Horovod
        added (its first fit) names them as the ranks going on with theirs."""
        import horovod.tensorflow as hvd

        resuming = self.method is not None and self.method.resuming
        mine = self._calls if resuming else self._calls + 1
        self._calls = int(hvd.allreduce(tf.constant([mine], tf.int64), op=hvd.Max, name="hvdx.adpsgd.fits")[0])
        if resuming:
            return self.method
        kwargs = dict(self._kwargs, name=f"{self._kwargs['name']}.{self._calls}")
        return ADPSGD(None, **kwargs, global_epochs=self.global_epochs, max_seconds=self.max_seconds,
                      average_every_epoch=self.average_every_epoch)


class SharedModelCallback(TrainingMethodCallback):
    """`TrainingMethodCallback(method)` for a shared-memory method (AsyncMiniBatch, ASSM,
    PASSM, PASSMPlus): the method's step replaces the model's for the duration of `fit`; at
    every epoch's end (and before validation) the variables hold the node's shared model, so
    callbacks after this one (ModelCheckpoint) save it; at the end of `fit` every rank holds
    the same final model (`finish()`). `stats` holds this rank's record (steps, staleness)
    after `fit`. Every rank must run the same number of steps and epochs (checked)."""

    kind = SharedModelMethod

    def __init__(self, method: SharedModelMethod) -> None:
        if not isinstance(method, SharedModelMethod):
            raise TypeError(f"SharedModelCallback takes an hvdx.asynchronous method (AsyncMiniBatch, ASSM, PASSM, "
                            f"PASSMPlus), got {type(method).__name__}")
        super().__init__(method)
