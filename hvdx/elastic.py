"""Elastic Horovod with hvdx: Horovod's `hvd.elastic` (run, commit / restore / sync, the
Keras callbacks) whose state objects also reset hvdx after a membership change.

    import hvdx.keras as hvd                   # hvd.elastic is this module
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(..., callbacks=[hvd.elastic.CommitStateCallback(state), ...])

Launch: `horovodrun --gloo -np 4 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh
python train.py` (docs/elastic.md). After Horovod's reset (shutdown, then init on the new
ranks) and before the state's sync, the state's `reset()` rebuilds hvdx's topology and
process sets for the new ranks (`hvdx.topology.reinit`) and drops the model's traced Keras
functions, so the next `fit` traces its step again and the strategies plan for the new
topology. Error-feedback residuals carry their owner (rank, size): one written under the
old membership is read as zeros by the new step (`hvdx.comm.memory`), never applied by a
rank or a layout it was not computed for.

A Keras 3 model (`import keras`, or tf.keras where it is Keras 3) takes the Keras 3 state:
the states are chosen by the model given, and keep its variables and its optimizer's through
Keras 3's API and `hvdx.broadcast_variables` (`hvdx.keras3_elastic`); Horovod's Keras elastic
callbacks serve its `fit` as they are.

A job launched by MPI cannot be elastic (Horovod supports elastic runs under Gloo only):
`run` raises `ElasticError` saying how to launch.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import horovod.tensorflow as _hvd
from horovod.common.elastic import ObjectState, State
from horovod.tensorflow import elastic as _tf_elastic
from horovod.tensorflow.keras import elastic as _keras_elastic

from hvdx.legacy_keras import is_keras3_object
from hvdx.lifecycle import reset_running
from hvdx.topology import initialized, reinit
from hvdx.variables import build_optimizer

__all__ = ["CommitStateCallback", "ElasticError", "KerasState", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "reset_hvdx", "run"]

CommitStateCallback = _keras_elastic.CommitStateCallback
UpdateBatchStateCallback = _keras_elastic.UpdateBatchStateCallback
UpdateEpochStateCallback = _keras_elastic.UpdateEpochStateCallback

#: The Keras model functions traced for the old ranks (process sets, slices, owners).
_TRACED = ("train_function", "test_function", "predict_function")


class ElasticError(RuntimeError):
    """An elastic run where elastic cannot work (e.g. a job launched by MPI)."""


def reset_hvdx(model: Optional[Any] = None) -> None:
    """After Horovod re-initialised on new ranks: rebuilds hvdx's topology and process sets
    (collective over the new ranks), resets every training method a driver is running
    (`hvdx.lifecycle.reset_running`: DASO, AD-PSGD, the shared-memory family, LocalSGD
    closed and planned for the new ranks, their `state()` kept; the next `fit` starts them
    collectively), splits every open DataCache again for the new ranks (`hvdx.data.datacache.
    reset_open`: its node store kept) and drops `model`'s traced Keras functions (and the
    validation data an interrupted `fit` kept) so that its next `fit` / `evaluate` / `predict`
    traces again for the new topology. Does nothing to the topology
    where `hvdx.init()` never ran (a plain Horovod script)."""
    if initialized():
        reset_running(reinit())
    from hvdx.data.datacache import reset_open

    reset_open()
    if model is not None:
        for name in _TRACED:
            if getattr(model, name, None) is not None:
                setattr(model, name, None)
        # Keras' fit keeps its validation data's handler (Keras 3: its iterator) until it
        # returns: one interrupted by the reset would serve the next fit the old validation
        # dataset (a DataCache's: split for the old ranks)
        for name in ("_eval_data_handler", "_eval_epoch_iterator"):
            if getattr(model, name, None) is not None:
                setattr(model, name, None)


class _KerasStateMixin:
    """What hvdx's Keras states add to Horovod's: the reset of hvdx, and a sync that first
    builds the optimizer's state, so that a worker added by a reset (which never trained)
    broadcasts as many optimizer variables as the workers that did: Horovod's sync broadcasts
    `optimizer.variables()`, which a Keras optimizer creates at its first update, and the
    ranks' broadcasts would not match (the job hangs where a node is added back).

    Given a Keras 3 model, a state is made of its Keras 3 subclass (`hvdx.keras3_elastic`)."""

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any):
        if model is not None and is_keras3_object(model):
            from hvdx.keras3_elastic import keras3_state

            cls = keras3_state(cls)
        return super().__new__(cls)

    def reset(self) -> None:
        reset_hvdx(self.model)
        super().reset()

    def _build_optimizer(self) -> None:
        build_optimizer(self.optimizer, self.model.trainable_variables)

    def sync(self) -> None:
        self._build_optimizer()
        super().sync()


class TensorFlowKerasState(_KerasStateMixin, _tf_elastic.TensorFlowKerasState):
    """Horovod's `TensorFlowKerasState` (model, optimizer, extra attributes) that also resets
    hvdx after a membership change (`reset_hvdx(model)`) and builds the optimizer's state
    before every sync (`hvdx.variables.build_optimizer`)."""


class KerasState(_KerasStateMixin, _keras_elastic.KerasState):
    """Horovod's Keras `KerasState` that also resets hvdx after a membership change and builds
    the optimizer's state before every sync."""


class TensorFlowState(_tf_elastic.TensorFlowState):
    """Horovod's `TensorFlowState` (a list of variables) that also resets hvdx's topology
    after a membership change. A custom loop's `tf.function` step must be created inside the
    function `run` wraps, so that it is traced again for the new ranks."""

    def reset(self) -> None:
        reset_hvdx()
        super().reset()


#: What a collective that failed because a rank died or Horovod shut down says: Horovod's ops
#: by type (eager calls, and Horovod's own DistributedOptimizer, whose node names carry the
#: type), the shutdown message every pending collective gets, and Gloo's own error, which the
#: collective running when the peer died gets (its source path, e.g. `.../gloo/transport/tcp/
#: pair.cc:589] Read error ...: Connection reset by peer`), and what a collective enqueued on
#: hvdx's node-local or cross-node process set gets once the failed loop has removed the sets
#: (Horovod patch 0002: "Process set provided does not exist, or has not been registered").
#: hvdx's graph-mode collectives are named after hvdx's buffers (e.g. `hvdx.2dtar.ar.v0_b1`),
#: not after the op type.
_COLLECTIVE_FAILURE = ("Horovod has been shut down", "HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast",
                       "HorovodAlltoall", "HorovodReducescatter", "HorovodGroupedAllreduce", "/gloo/", "gloo::",
                       "Process set provided does not exist")


def _is_collective_failure(error: BaseException) -> bool:
    """Whether `error` is a TensorFlow op error from a Horovod collective that failed."""
    import tensorflow as tf

    return isinstance(error, tf.errors.OpError) and any(s in (error.message or "") for s in _COLLECTIVE_FAILURE)


def _reset_horovod() -> None:
    _hvd.shutdown()
    _hvd.init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's `hvd.elastic.run` (the decorator of the elastic training function), which
    first checks that the job can be elastic, and which tells every failed collective from
    other errors: a TensorFlow error from a Horovod collective (`_COLLECTIVE_FAILURE`)
    becomes Horovod's `HorovodInternalError` (restore the last commit, reset, go on), any
    other error propagates. Horovod's own TensorFlow `run` returns None, as if training had
    ended, on an `UnknownError` whose message names no Horovod op type: the shutdown error
    of a collective named otherwise (hvdx's strategies' ops, in a traced step) ended the
    training of every survivor of a dead rank without a word.

    Raises:
      ElasticError: when called in a job launched by MPI.
    """
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError

    @functools.wraps(func)
    def classified(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - re-raised unless a collective failed
            if _is_collective_failure(error):
                raise HorovodInternalError(error) from error
            raise

    elastic = run_fn(classified, _reset_horovod)

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if _hvd.is_initialized() and _hvd.mpi_enabled():
            raise ElasticError(
                "hvd.elastic.run needs an elastic Gloo launch, and this job was launched by MPI (Horovod "
                "supports elastic runs under Gloo only). Launch with `horovodrun --gloo -np N --min-np MIN "
                "--max-np MAX --host-discovery-script SCRIPT python train.py` (docs/elastic.md).")
        return elastic(state, *args, **kwargs)

    return wrapper
