"""The elastic state of a Keras 3 model: what hvdx.elastic's `KerasState` and
`TensorFlowKerasState` save, restore and sync when the model given is a Keras 3 one.

Horovod's `TensorFlowKerasState` reaches the optimizer through Keras 2 (`optimizer.variables()`,
a list property in Keras 3) and syncs with Horovod's `broadcast_variables`, which cannot assign
a Keras 3 variable (horovod#4290). `keras3_state(cls)` is the subclass of one of hvdx's Keras
states that hvdx.elastic makes for a Keras 3 model (the state's class is chosen by the model,
`hvdx.legacy_keras.is_keras3_object`), with everything else of `cls` kept (the reset of hvdx,
the extra attributes, the reset callbacks):

- save / restore: numpy copies of `model.variables` and of the optimizer's variables (Keras 3:
  the `optimizer.variables` list; hvdx's Keras 3 wrapper lists the wrapped optimizer's), in
  the order Keras lists them;
- sync: the optimizer built first if Keras has not built it yet (a process Elastic Horovod
  added never trained: it would broadcast fewer variables and the job hang; never built again,
  since a LossScaleOptimizer makes new variables at every build), then `hvdx.broadcast_variables`
  of both lists from rank 0;
- hvdx's error-feedback residuals (`optimizer.aggregator.residuals`) are neither saved, restored
  nor broadcast, as on the Keras 2 path: they are per rank and carry their owner
  (`hvdx.comm.memory`), so one written under another membership is read as zeros.

Horovod's Keras elastic callbacks (`CommitStateCallback`, `UpdateBatchStateCallback`,
`UpdateEpochStateCallback`) serve a Keras 3 `fit` as they are: they read only `params` and
the state, and Keras 3's CallbackList calls them by name where tf.keras is Keras 2 too.
"""
from __future__ import annotations

import functools
from typing import Any, List

import numpy as np

from hvdx.variables import broadcast_variables, build_optimizer, tf_variable

__all__ = ["keras3_state", "optimizer_variables"]


def optimizer_variables(optimizer: Any) -> List[Any]:
    """`optimizer`'s variables, in Keras' order (a Keras 3 list; a Keras 2 optimizer's call),
    less hvdx's per-rank residuals (`optimizer.aggregator.residuals`)."""
    variables = optimizer.variables
    variables = list(variables() if callable(variables) else variables)
    residuals = {id(tf_variable(v)) for v in getattr(getattr(optimizer, "aggregator", None), "residuals", ())}
    return [v for v in variables if id(tf_variable(v)) not in residuals]


class Keras3State:
    """What replaces Horovod's Keras 2 save / restore / broadcast for a Keras 3 model (put
    before one of hvdx.elastic's Keras states by `keras3_state`)."""

    def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        self._bcast_model = self._broadcast  # Horovod's __init__ set its Keras 2 broadcast

    def _variables(self):
        return list(self.model.variables), optimizer_variables(self.optimizer)

    def _build_optimizer(self) -> None:
        if not getattr(self.optimizer, "built", False):
            build_optimizer(self.optimizer, self.model.trainable_variables)

    def _broadcast(self) -> None:
        model_variables, opt_variables = self._variables()
        broadcast_variables(model_variables + opt_variables, root_rank=0)

    def _save_model(self) -> None:
        model_variables, opt_variables = self._variables()
        self._saved_model_state = [np.array(v.numpy(), copy=True) for v in model_variables]
        self._saved_optimizer_state = [np.array(v.numpy(), copy=True) for v in opt_variables]

    def _load_model(self) -> None:
        for variables, saved, what in zip(self._variables(), (self._saved_model_state, self._saved_optimizer_state),
                                          ("model", "optimizer")):
            if len(variables) != len(saved):
                raise ValueError(f"the elastic state saved {len(saved)} {what} variables and the {what} now has "
                                 f"{len(variables)}: it cannot restore the commit")
            for variable, value in zip(variables, saved):
                variable.assign(value)


@functools.lru_cache(maxsize=None)
def keras3_state(cls: type) -> type:
    """The subclass of `cls` (one of hvdx.elastic's Keras states, or a subclass of one) that
    keeps the state of a Keras 3 model (`Keras3State`)."""
    if issubclass(cls, Keras3State):
        return cls
    return type(cls.__name__, (Keras3State, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                   "__doc__": cls.__doc__})
