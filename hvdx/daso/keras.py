"""DASO's Keras glue: `DASOCallback`, hvdx's one method driver
(`hvdx.callbacks.TrainingMethodCallback`) for the model's hvdx.DASO optimizer.

    model.compile(optimizer=hvdx.DASO(tf.keras.optimizers.SGD(0.1), total_epochs=20), loss=...)
    model.fit(..., callbacks=[hvdx.daso.DASOCallback()])
"""
from __future__ import annotations

from typing import Optional

from hvdx.callbacks.method import TrainingMethodCallback
from hvdx.daso.method import DASOMethod

__all__ = ["DASOCallback"]


class DASOCallback(TrainingMethodCallback):
    """`TrainingMethodCallback` for the model's hvdx.DASO optimizer, of either Keras (or `daso`, if given): after
    every batch the schedule's global synchronisation (`DASO.after_step`), after the last
    batch of an epoch the drain and the epoch's training loss (`DASO.end_epoch`), at the end
    `DASO.close()`; before the first batch the check that every rank runs as many steps and
    epochs. `daso` is the optimizer driven.

    Raises (from `fit`): ValueError where the model's optimizer is no hvdx.DASO and none was
    given; TypeError for a `daso` that is no hvdx.DASO."""

    kind = DASOMethod

    def __init__(self, daso: Optional[DASOMethod] = None) -> None:
        super().__init__(daso)

    @property
    def daso(self) -> Optional[DASOMethod]:
        return self.method

    def _missing(self) -> str:
        return "DASOCallback needs a model compiled with hvdx.DASO(...) as its optimizer"
