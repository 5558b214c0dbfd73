"""One lifecycle for every training method that is more than one synchronous step: DASO,
AD-PSGD, the shared-memory family (AsyncMiniBatch, ASSM, PASSM, PASSM+), LocalSGD, Streaming DiLoCo.

A method is a `TrainingMethod`. A driver (Keras: `hvdx.callbacks.TrainingMethodCallback`; a
custom loop: the loop itself) calls its hooks in this order, on every rank:

    method.start(model, optimizer, steps_per_epoch=..., epochs=...)  # collective: one model
    for epoch in epochs:
        if method.begin_epoch(epoch): retrace the step function
        for batch in epoch:
            step (method.train_step(model, data) where method.replaces_train_step)
            method.after_step()                       # between steps, eager
            if method.should_stop(): stop
        method.end_epoch(epoch, logs)                 # before validation and checkpoints
        method.before_evaluation(); evaluate
    method.finish()                                   # collective: one model on every rank
    method.close()                                    # always, also after an error

`state()` / `restore(state)` carry what a checkpoint must keep (JSON); `reset(topology)`
drops what was built for the old ranks without collectives when the membership changes, and
the next `start()` rebuilds it (collective over the new ranks). A driver marks a method
`running(method)` after its start and `stopped(method)` after its close; Elastic Horovod's
reset (`hvdx.elastic`) calls `reset_running()`, which closes and resets every method still
running (a `fit` that a failed collective or a host change interrupted). A new method is one module
that subclasses `TrainingMethod` and overrides the hooks it needs (`hvdx.localsgd`); the
driver and the Keras callback need no change. Design: docs/design.md ("Methods beside the
step: one lifecycle").
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Type, TypeVar

from hvdx.wrapped import check_not_synchronous

if TYPE_CHECKING:
    from hvdx.topology import Topology

__all__ = ["TrainingMethod", "check_not_synchronous", "find_method", "reset_running", "running", "stopped"]

M = TypeVar("M", bound="TrainingMethod")


class TrainingMethod:
    """The protocol every method implements (module docstring). A plain base class (a
    method may also be a Keras optimizer, as DASO is); each hook's default does nothing.

    Class attributes a driver reads:
      label: the method's name in messages ("AD-PSGD").
      same_steps_on_every_rank: whether every rank must run as many steps per epoch and
        epochs (its collectives count steps); a Keras driver checks it collectively before
        the first batch.
      needs_every_step: whether `after_step()` must follow every single step (Keras:
        steps_per_execution=1).
      replaces_train_step: whether the method's own `train_step(model, data)` replaces Keras'
        for the duration of `fit`.
      plain_optimizer_example: a plain optimizer to name in `check_optimizer`'s message.
    """

    label: str = "a training method"
    same_steps_on_every_rank: bool = True
    needs_every_step: bool = True
    replaces_train_step: bool = False
    plain_optimizer_example: str = "tf.keras.optimizers.SGD(0.1)"

    # -- the run ---------------------------------------------------------------------------
    def start(self: M, model_or_variables: Any, optimizer: Any = None, *, steps_per_epoch: Optional[int] = None,
              epochs: Optional[int] = None) -> M:
        """Collective over all ranks: builds what the method needs for these ranks and makes
        every rank start from one model. Returns self.

        Args:
          model_or_variables: a Keras model, or the list of variables the method works on.
          optimizer: the (plain) optimizer the steps use, where the method needs it.
          steps_per_epoch, epochs: how long training runs, where the driver knows it (Keras'
            params), else None.
        """
        return self

    def begin_epoch(self, epoch: int) -> bool:
        """Before the epoch's first step (eager). Returns True when the step function must be
        traced again (e.g. PASSM+ changing phase)."""
        return False

    def after_step(self) -> None:
        """After each step's update, between steps (eager); collective for methods whose ranks
        run the same steps (`same_steps_on_every_rank`)."""

    def end_epoch(self, epoch: int, logs: Optional[Mapping[str, Any]]) -> None:
        """After the epoch's last step, before validation and before other callbacks'
        on_epoch_end (checkpoints). `logs`: the epoch's training logs ("loss")."""

    def before_evaluation(self) -> None:
        """Before an evaluation during training: the variables take the model the method
        evaluates (e.g. the node's shared model)."""

    def should_stop(self) -> bool:
        """After each step: whether training should end now (a step budget, a time limit)."""
        return False

    def train_step(self, model: Any, data: Any) -> Any:
        """One Keras step (traced), used in place of `model.train_step` during `fit` where
        `replaces_train_step`; returns the metrics' logs. The default is the model's own."""
        return type(model).train_step(model, data)

    def finish(self) -> None:
        """Collective: every rank ends with one model; idempotent."""

    def close(self) -> None:
        """Releases what `start()` built (sockets, threads, shared memory) without any
        collective; idempotent, never hangs, also after an error."""

    # -- checkpoints and membership ---------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        """What a checkpoint must keep beside the model's variables (JSON-serialisable)."""
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Takes back a `state()` (before `start()`, or between epochs)."""

    def reset(self, topology: Optional["Topology"] = None) -> None:
        """The membership changed (`topology`: the new one, default `hvdx.topology()`): drops
        what was built for the old ranks WITHOUT collectives, keeps `state()`, and plans for
        the new ranks; the next `start()` rebuilds collectively."""

    def stats(self) -> Dict[str, Any]:
        """This rank's record of the run (counts, timings)."""
        return {}

    # -- shared checks ------------------------------------------------------------------------
    @classmethod
    def check_optimizer(cls, optimizer: Any) -> None:
        """ValueError if `optimizer` (or one it wraps) averages gradients synchronously: an
        hvdx or Horovod DistributedOptimizer, DASO, or a subclass of one
        (`hvdx.wrapped.check_not_synchronous`); an asynchronous method replaces that
        averaging, it does not add to it."""
        check_not_synchronous(optimizer, cls.label, cls.plain_optimizer_example)


def find_method(optimizer: Any, kind: Type[M] = TrainingMethod) -> Optional[M]:
    """The `kind` instance along `optimizer` and the optimizers it wraps (`inner_optimizer`,
    e.g. a LossScaleOptimizer around DASO), or None."""
    while optimizer is not None:
        if isinstance(optimizer, kind):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


#: The methods a driver started and has not closed (weakly held: a method nobody holds is gone).
_RUNNING: "weakref.WeakSet[TrainingMethod]" = weakref.WeakSet()


def running(method: TrainingMethod) -> None:
    """A driver started `method` (after `start()`): a membership change resets it."""
    _RUNNING.add(method)


def stopped(method: TrainingMethod) -> None:
    """A driver closed `method` (after `close()`)."""
    _RUNNING.discard(method)


def reset_running(topology: Optional["Topology"] = None) -> List[str]:
    """The membership changed (Elastic Horovod's reset, after `hvdx.topology.reinit`): every
    running method is closed and `reset(topology)` (no collective), its `state()` kept; the
    driver's next `start()` rebuilds it for the new ranks. Returns the methods' labels.

    Raises what a method's `reset` raises (e.g. a method that cannot plan for the new ranks).
    """
    methods = list(_RUNNING)
    _RUNNING.clear()
    for method in methods:
        method.close()
        method.reset(topology)
    return [method.label for method in methods]
