"""Keras callbacks for hvdx training.

`BroadcastGlobalVariablesCallback` is Horovod's (same arguments, same behaviour: the
model's and the optimizer's variables are broadcast from `root_rank` after the first batch)
plus a check, before the first batch, that every rank will run the same number of steps
and epochs: otherwise the rank with more steps waits for ever in a collective the others
never issue. `SwitchCommunication` switches the aggregation strategy during training (the
DAWNBench recipe trains its first epochs with MSTopK and then switches to 2DTAR, shi2021
sec. 5.6). Horovod's other callbacks work unchanged with hvdx's optimizer.
"""
from __future__ import annotations

from typing import Union

import horovod.tensorflow.keras.callbacks as hvd_callbacks
import tensorflow as tf

from hvdx import comm
from hvdx.layout import check_agreement

__all__ = ["BroadcastGlobalVariablesCallback", "SwitchCommunication", "check_same_steps"]


def check_same_steps(params: dict, name: str = "hvdx.steps") -> None:
    """Collective: RankMismatchError on every rank unless all run as many steps per epoch
    and epochs (Keras' callback params)."""
    description = {"steps per epoch": str(params.get("steps")), "epochs": str(params.get("epochs"))}
    check_agreement(description, "how long they train (give every rank an equally long shard, or the same "
                                 "steps_per_epoch)", name)


class BroadcastGlobalVariablesCallback(hvd_callbacks.BroadcastGlobalVariablesCallback):
    """Horovod's broadcast of the initial state from `root_rank`, after checking that every
    rank runs the same number of steps (fails on every rank, naming them, if not)."""

    def on_train_begin(self, logs=None) -> None:
        check_same_steps(self.params or {})


class SwitchCommunication(tf.keras.callbacks.Callback):
    """At the start of epoch `epoch`, switch the hvdx.DistributedOptimizer's strategy to
    `communication`, and have Keras trace the step function again."""

    def __init__(self, epoch: int, communication: Union[str, comm.Strategy]) -> None:
        super().__init__()
        self.epoch = epoch
        self.communication = communication

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        if epoch == self.epoch:
            optimizer = self.model.optimizer
            while not hasattr(optimizer, "set_communication") and hasattr(optimizer, "inner_optimizer"):
                optimizer = optimizer.inner_optimizer  # under a LossScaleOptimizer
            optimizer.set_communication(self.communication)
            self.model.make_train_function(force=True)
