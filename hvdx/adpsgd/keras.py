"""AD-PSGD's Keras glue: `ADPSGDCallback`, hvdx's one method driver
(`hvdx.callbacks.TrainingMethodCallback`) building an `ADPSGD` per `fit`.

    model.fit(..., callbacks=[hvdx.adpsgd.ADPSGDCallback(topology="ring", max_seconds=600)])
"""
from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

from hvdx.adpsgd.graph import Edges, build_graph
from hvdx.adpsgd.method import ADPSGD, check_cross_node_weight, check_fit_options
from hvdx.callbacks.method import TrainingMethodCallback

__all__ = ["ADPSGDCallback"]


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

