"""The Keras glue of DASO: Model.fit feeds it steps, epochs and the training loss.

    model.fit(..., callbacks=[hvdx.daso.DASOCallback()])

After every batch the callback runs the schedule's global synchronisation
(`DASO.after_step`); after the last batch of an epoch it drains the exchange in flight
(every rank then holds the same parameters, before validation and before any other
callback's on_epoch_end, e.g. ModelCheckpoint) and hands the epoch's training loss to
the schedule (`DASO.end_epoch`). When training ends it closes DASO's transport
(`DASO.close`). Before the first batch it checks that every rank runs as many steps and
epochs (DASO itself starts every rank from rank 0's parameters). No manual per-epoch call
is needed.
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from hvdx.callbacks import check_same_steps
from hvdx.daso.optimizer import DASO

__all__ = ["DASOCallback"]


def find_daso(optimizer) -> Optional[DASO]:
    """The DASO optimizer inside `optimizer` (a LossScaleOptimizer may wrap it)."""
    while optimizer is not None:
        if isinstance(optimizer, DASO):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


class DASOCallback(tf.keras.callbacks.Callback):
    """Drives the model's hvdx.DASO optimizer during Model.fit (or `daso`, if given)."""

    def __init__(self, daso: Optional[DASO] = None) -> None:
        super().__init__()
        self.daso = daso
        self._steps: Optional[int] = None
        self._epoch_ended = False

    def on_train_begin(self, logs=None) -> None:
        daso = self.daso or find_daso(self.model.optimizer)
        if daso is None:
            raise ValueError("DASOCallback needs a model compiled with hvdx.DASO(...) as its optimizer")
        self.daso = daso
        steps_per_execution = getattr(self.model, "_steps_per_execution", None)
        if steps_per_execution is not None and int(steps_per_execution.numpy()) != 1:
            raise ValueError("DASO synchronises between steps: compile the model with steps_per_execution=1")
        params = self.params or {}
        check_same_steps(params, name="hvdx.daso.steps")
        self._steps = params.get("steps")

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        self._epoch_ended = False
        self.daso.start_epoch(epoch)

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        self.daso.after_step()
        if self._steps is not None and batch + 1 == self._steps:
            self._end_epoch(logs)

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        if not self._epoch_ended:  # steps per epoch unknown (a dataset of unknown length)
            self._end_epoch(logs)

    def on_train_end(self, logs=None) -> None:
        self.daso.close()  # drained by the last epoch's end; a later fit() opens a new transport

    def _end_epoch(self, logs) -> None:
        loss = (logs or {}).get("loss")
        if loss is None:
            raise ValueError("DASOCallback needs the training loss in Keras' logs (compile the model with a loss)")
        self.daso.end_epoch(float(loss))
        self._epoch_ended = True
