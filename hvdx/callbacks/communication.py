"""The aggregation strategy during `Model.fit`.

`SwitchCommunication` switches the hvdx.DistributedOptimizer's strategy at an epoch (the
DAWNBench recipe trains its first epochs with MSTopK and then switches to 2DTAR, shi2021
sec. 5.6); `CommunicationPolicy` chains such switches, at configured epochs or when the
training loss plateaus (`hvdx.plateau`).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import tensorflow as tf

from hvdx import comm
from hvdx.arguments import is_integer
from hvdx.plateau import PlateauDetector
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["CommunicationPolicy", "Phase", "SwitchCommunication", "switch"]


class SwitchCommunication(keras2.callbacks.Callback):
    """At the start of epoch `epoch`, switch the hvdx.DistributedOptimizer's strategy to
    `communication`, and have Keras trace the step function again."""

    def __init__(self, epoch: int, communication: Union[str, comm.Strategy]) -> None:
        super().__init__()
        self.epoch = epoch
        self.communication = communication

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        if epoch == self.epoch:
            switch(self.model, self.communication)


def switch(model: keras2.Model, communication: Union[str, comm.Strategy]) -> None:
    """Sets the strategy of `model`'s hvdx.DistributedOptimizer (under a LossScaleOptimizer
    too) and has Keras trace the step function again."""
    optimizer = model.optimizer
    while not hasattr(optimizer, "set_communication") and hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer  # under a LossScaleOptimizer
    if not hasattr(optimizer, "set_communication"):
        raise ValueError(f"the model's optimizer {type(optimizer).__name__} is not an hvdx.DistributedOptimizer: "
                         "wrap it with hvdx.DistributedOptimizer(optimizer) to switch its communication")
    optimizer.set_communication(communication)
    model.make_train_function(force=True)


#: A phase of `CommunicationPolicy`: (strategy, when it ends): an epoch (the next phase
#: starts at the beginning of that epoch), "plateau" (the epoch after the training loss
#: plateaus), or None (the last phase).
Phase = Tuple[Union[str, comm.Strategy], Union[int, str, None]]


class CommunicationPolicy(keras2.callbacks.Callback):
    """shi2021 sec. 5.6's practice as a policy: e.g. a dense warm-up, then HiTopK while the
    loss falls, then 2DTAR once it plateaus (sparse aggregation "would cause accuracy loss"
    late in training)::

        CommunicationPolicy([("allreduce", 1), ("hitopk", "plateau"), ("hierarchical", None)])

    Each switch is `SwitchCommunication`'s (the strategies keep their residuals). The
    plateau is `hvdx.plateau.PlateauDetector`'s rule (`patience` + 1 epochs whose loss
    is not `threshold` below the best) on the epoch's training loss averaged over every rank
    (one small allreduce per epoch), so every rank switches at the same epoch.
    `history` lists (epoch, strategy name) of each phase started.

    Raises:
      ValueError: no phases, an end that is not an increasing epoch, "plateau" or None, or
        None before the last phase.
    """

    def __init__(self, phases: Sequence[Phase], patience: int = 2, threshold: float = 0.05,
                 monitor: str = "loss") -> None:
        super().__init__()
        phases = [(communication, int(end) if is_integer(end) else end) for communication, end in phases]
        if not phases:
            raise ValueError("CommunicationPolicy needs at least one (communication, end) phase")
        last = -1
        for i, (communication, end) in enumerate(phases):
            comm.get(communication) if isinstance(communication, str) else None  # a name that exists
            if end is None and i != len(phases) - 1:
                raise ValueError(f"phase {i} ({communication!r}) never ends (None) but phases follow it")
            if is_integer(end):
                if end <= last:
                    raise ValueError(f"phase {i} ends at epoch {end}, not after the previous phase's {last}")
                last = end
            elif end not in ("plateau", None):
                raise ValueError(f"a phase ends at an epoch (int), 'plateau' or None (never), got {end!r}")
        self.phases: List[Phase] = phases
        self.monitor = monitor
        self.detector = PlateauDetector(patience=patience, threshold=threshold)
        self.phase = 0
        self.history: List[Tuple[int, str]] = []
        self._plateaued = False

    def _start(self, epoch: int, phase: int) -> None:
        self.phase = phase
        self.detector.reset()
        self._plateaued = False
        communication = self.phases[phase][0]
        switch(self.model, communication)
        self.history.append((epoch, communication if isinstance(communication, str) else communication.key))

    def on_train_begin(self, logs=None) -> None:
        if not self.history:
            self._start(0, 0)

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        end = self.phases[self.phase][1]
        while self.phase + 1 < len(self.phases) and (
                (is_integer(end) and epoch >= end) or (end == "plateau" and self._plateaued)):
            self._start(epoch, self.phase + 1)
            end = self.phases[self.phase][1]

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        if self.phases[self.phase][1] != "plateau" or not logs or self.monitor not in logs:
            return
        import horovod.tensorflow as hvd

        loss = float(hvd.allreduce(tf.constant(float(logs[self.monitor]), tf.float64), op=hvd.Average,
                                   name=f"hvdx.policy.loss.{epoch}"))
        self._plateaued = self._plateaued or self.detector.update(loss)
