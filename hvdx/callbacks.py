"""Keras callbacks for hvdx training: initial broadcast, and switching the aggregation
strategy during training (the DAWNBench recipe trains its first epochs with MSTopK and then
switches to 2DTAR, shi2021 sec. 5.6)."""
from __future__ import annotations

from typing import Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import comm

__all__ = ["BroadcastGlobalVariablesCallback", "SwitchCommunication"]


class BroadcastGlobalVariablesCallback(tf.keras.callbacks.Callback):
    """Before the first step, every rank takes root_rank's model and optimizer variables
    (the optimizer's slots are built first, so they are broadcast too)."""

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs=None) -> None:
        optimizer = self.model.optimizer
        optimizer.build(self.model.trainable_variables)
        variables = list(self.model.variables) + list(optimizer.variables)
        hvd.broadcast_variables(variables, root_rank=self.root_rank)


class SwitchCommunication(tf.keras.callbacks.Callback):
    """At the start of epoch `epoch`, switch the hvdx.DistributedOptimizer's strategy to
    `communication`, and have Keras trace the step function again."""

    def __init__(self, epoch: int, communication: Union[str, comm.Strategy]) -> None:
        super().__init__()
        self.epoch = epoch
        self.communication = communication

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        if epoch == self.epoch:
            self.model.optimizer.set_communication(self.communication)
            self.model.make_train_function(force=True)
