"""The epochs of a phased training run (`hvdx.phases`) in `Model.fit`: how long each took
(`EpochTimer`, `hvdx.throughput.EpochTime`) and what it trained with (`EpochLog`, the records
`hvdx.history` and `hvdx.throughput` read)."""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

import tensorflow as tf

from hvdx.phases import Phase, phase_at
from hvdx.throughput import EpochTime
from hvdx.wrapper_core import is_keras3_optimizer
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["EpochLog", "EpochTimer", "last_step_rate"]


def last_step_rate(optimizer) -> float:
    """The learning rate `optimizer`'s last step used, of either Keras. Keras 2 keeps it (a
    schedule's `learning_rate` reads the rate its last update computed); Keras 3 evaluates a
    schedule at `iterations`, the next step's, so its schedule is evaluated here at the step
    before (0 before any)."""
    schedule = getattr(optimizer, "_learning_rate", None)
    if is_keras3_optimizer(optimizer) and callable(schedule) and not hasattr(schedule, "assign"):
        step = max(int(optimizer.iterations.numpy()) - 1, 0)
        return float(schedule(tf.constant(step, tf.int64)))
    return float(optimizer.learning_rate)


class EpochTimer(keras2.callbacks.Callback):
    """Times each epoch of `Model.fit`: `last` is the EpochTime of the epoch that just ended
    (set at the start of `on_epoch_end`; a subclass reads it after `super().on_epoch_end`).
    Its per-batch work is one clock read at the first batch of an epoch."""

    _supports_tf_logs = True  # its batch hook reads no logs: Keras need not convert them each step

    def __init__(self) -> None:
        super().__init__()
        self.last: Optional[EpochTime] = None
        self._started = 0.0
        self._trained: Optional[float] = None
        self._first: Optional[float] = None

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        self._started, self._trained, self._first = time.perf_counter(), None, None

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        if self._first is None:
            self._first = time.perf_counter() - self._started

    def on_test_begin(self, logs=None) -> None:
        if self._trained is None:  # fit validates inside the epoch: its training steps end here
            self._trained = time.perf_counter() - self._started

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        epoch_seconds = time.perf_counter() - self._started
        self.last = EpochTime(self.params["steps"], epoch_seconds if self._trained is None else self._trained,
                              epoch_seconds, self._first)


class EpochLog(EpochTimer):
    """After every epoch, appends to `history` a dict: "epoch", "phase" (index into
    `phases`), "resolution", "batch_size", "communication" (the class name of the
    hvdx.DistributedOptimizer's strategy), "steps", "seconds" (the training steps),
    "epoch_seconds" (with validation), "ranks", "elapsed" (the run's epochs so far, from `elapsed`:
    the time of the epochs before a resume), "step_s" and "samples_per_s" (over `ranks`
    ranks; `EpochTime`), "lr" (the rate of the wrapped optimizer's last step, `last_step_rate`), and the epoch's logs as floats (put
    Horovod's MetricAverageCallback before it for metrics averaged over ranks)."""

    def __init__(self, phases: Sequence[Phase], ranks: int, history: List[dict], elapsed: float = 0.0) -> None:
        super().__init__()
        self.phases, self.ranks, self.history, self.elapsed = list(phases), ranks, history, elapsed

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        super().on_epoch_end(epoch, logs)
        time = self.last
        self.elapsed += time.epoch_seconds
        index, phase = phase_at(self.phases, epoch)
        optimizer = self.model.optimizer
        while not hasattr(optimizer, "communication") and hasattr(optimizer, "inner_optimizer"):
            optimizer = optimizer.inner_optimizer  # under a LossScaleOptimizer
        self.history.append(dict(
            epoch=epoch, phase=index, resolution=phase.resolution, batch_size=phase.batch_size,
            communication=type(optimizer.communication).__name__, steps=time.steps, seconds=time.seconds,
            epoch_seconds=time.epoch_seconds, ranks=self.ranks, elapsed=self.elapsed, step_s=time.step_s,
            samples_per_s=time.samples_per_s(phase.batch_size, self.ranks),
            lr=last_step_rate(optimizer.inner_optimizer), **{k: float(v) for k, v in (logs or {}).items()}))
