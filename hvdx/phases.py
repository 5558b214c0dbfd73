"""Progressive resizing: training as a list of phases, and the learning rate over them.

shi2021 sec. 5.6 / Table 4 trains ResNet-50 in phases of increasing resolution, each
`epochs` epochs at `resolution` px (square) with `batch_size` samples per rank:
"13x96@256,11x128@256,3x224@256,1x288@128". Each phase has its own steps per epoch, so the
learning rate is a function of the fractional epoch, not of the step (`PhaseSchedule`: a
Keras learning-rate schedule of tf.keras' Keras, Keras 3 from TensorFlow 2.16 on unless
$TF_USE_LEGACY_KERAS=1; `schedule_class(keras)` for a given Keras).

    phases = parse_phases("3x24@32,2x32@32,1x40@16")
    index, phase = phase_at(phases, epoch)
    schedule = PhaseSchedule.over(phases, steps_per_epoch=[31, 31, 63], peak=8.0, warmup_epochs=1.0)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["Phase", "PhaseRule", "PhaseSchedule", "first_step", "parse_phases", "phase_at", "phase_start",
           "schedule_class", "total_epochs"]


@dataclass(frozen=True)
class Phase:
    """`epochs` epochs at `resolution` px (square) with `batch_size` samples per rank."""

    epochs: int
    resolution: int
    batch_size: int

    def __str__(self) -> str:
        return f"{self.epochs}x{self.resolution}@{self.batch_size}"


_PHASE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*@\s*(\d+)\s*$")


def parse_phases(spec: str) -> List[Phase]:
    """Phases from "EPOCHSxRESOLUTION@BATCH,..." (e.g. "13x96@256,11x128@256").

    Raises:
        ValueError: an item that is not three positive integers in that form (it is named).
    """
    phases = []
    for item in spec.split(","):
        match = _PHASE.match(item)
        if not match or min(int(g) for g in match.groups()) < 1:
            raise ValueError(f"bad phase {item!r} in {spec!r}: write EPOCHSxRESOLUTION@BATCH with positive "
                             f"integers, phases separated by commas, e.g. 13x96@256,11x128@256")
        phases.append(Phase(*(int(g) for g in match.groups())))
    return phases


def total_epochs(phases: Sequence[Phase]) -> int:
    """The epochs of all phases together."""
    return sum(p.epochs for p in phases)


def phase_start(phases: Sequence[Phase], index: int) -> int:
    """The first epoch (0-based) of phase `index`."""
    return sum(p.epochs for p in phases[:index])


def phase_at(phases: Sequence[Phase], epoch: int) -> Tuple[int, Phase]:
    """(index, phase) that trains `epoch` (0-based).

    Raises:
        ValueError: `epoch` is past the last phase.
    """
    start = 0
    for i, phase in enumerate(phases):
        if epoch < start + phase.epochs:
            return i, phase
        start += phase.epochs
    raise ValueError(f"epoch {epoch} is past the last phase (training has {total_epochs(phases)} epochs)")


def first_step(phases: Sequence[Phase], steps_per_epoch: Sequence[int], epoch: int) -> int:
    """The optimizer step (0-based, counted over all phases) at which `epoch` starts, phase i
    having `steps_per_epoch[i]` steps per epoch (`epoch` = the total: the step after the last)."""
    step, start = 0, 0
    for steps, phase in zip(steps_per_epoch, phases):
        step += steps * min(max(epoch - start, 0), phase.epochs)
        start += phase.epochs
    return step


class PhaseRule:
    """The learning rate of a phased run: the optimizer step is mapped to a fractional
    epoch e over phases of `steps_per_epoch[i]` steps for `epochs[i]` epochs; then

        lr = peak (0.1 + 0.9 e / W)             for e < W (linear warm-up),
        lr = peak ((T - e) / (T - W))^power     after (polynomial decay to 0 at e = T),

    times `batch_scale[i]` in phase i (linear scaling: shi2021's last phase halves the
    batch, and its rate with it). W = `warmup_epochs`, T = `total_epochs`. The rule alone;
    `PhaseSchedule` (`schedule_class`) is it as a Keras schedule, serializable (Keras
    config; registered as "hvdx>PhaseSchedule" in its Keras)."""

    def __init__(self, peak: float, warmup_epochs: float, total_epochs: int, power: float,
                 steps_per_epoch: Sequence[int], epochs: Sequence[int], batch_scale: Sequence[float]) -> None:
        self.peak, self.warmup_epochs, self.total_epochs, self.power = peak, warmup_epochs, total_epochs, power
        self.steps_per_epoch, self.epochs, self.batch_scale = list(steps_per_epoch), list(epochs), list(batch_scale)

    @classmethod
    def over(cls, phases: Sequence[Phase], steps_per_epoch: Sequence[int], peak: float, warmup_epochs: float,
             power: float = 2.0) -> "PhaseRule":
        """The schedule over `phases` (T: their epochs; each phase's batch scale: its batch
        over the first phase's), phase i having `steps_per_epoch[i]` steps per epoch."""
        return cls(peak, warmup_epochs, total_epochs(phases), power, steps_per_epoch, [p.epochs for p in phases],
                   [p.batch_size / phases[0].batch_size for p in phases])

    def epoch(self, step) -> tf.Tensor:
        """The fractional epoch (float64) at optimizer step `step` (0-based)."""
        step = tf.cast(step, tf.float64)
        epoch, start = tf.constant(0.0, tf.float64), 0
        for steps, epochs in zip(self.steps_per_epoch, self.epochs):
            epoch += tf.clip_by_value((step - start) / steps, 0.0, float(epochs))
            start += steps * epochs
        return epoch

    def __call__(self, step) -> tf.Tensor:
        e = self.epoch(step)
        w, t = max(self.warmup_epochs, 1e-9), float(self.total_epochs)
        warm = 0.1 + 0.9 * e / w
        decay = tf.maximum((t - e) / max(t - self.warmup_epochs, 1e-9), 0.0) ** self.power
        scale = tf.constant(self.batch_scale[-1], tf.float64)
        for s, n in reversed(list(zip(self.batch_scale[:-1], np.cumsum(self.epochs)[:-1]))):
            scale = tf.where(e < float(n), tf.constant(s, tf.float64), scale)
        return tf.cast(self.peak * scale * tf.where(e < w, warm, decay), tf.float32)

    def get_config(self) -> dict:
        return dict(peak=self.peak, warmup_epochs=self.warmup_epochs, total_epochs=self.total_epochs,
                    power=self.power, steps_per_epoch=self.steps_per_epoch, epochs=self.epochs,
                    batch_scale=self.batch_scale)


_CLASSES: Dict[str, type] = {}


def schedule_class(keras: Optional[ModuleType] = None) -> type:
    """`PhaseRule` as a learning-rate schedule of `keras` (a Keras API module: `keras`,
    `tf_keras`, tf.keras; None: tf.keras), registered there as "hvdx>PhaseSchedule"; one
    class per Keras, made at the first call."""
    keras = keras if keras is not None else tf.keras
    base = keras.optimizers.schedules.LearningRateSchedule
    key = f"{base.__module__}.{base.__qualname__}"
    if key not in _CLASSES:
        made = type("PhaseSchedule", (PhaseRule, base), {"__module__": __name__, "__doc__": PhaseRule.__doc__})
        _CLASSES[key] = keras.utils.register_keras_serializable(package="hvdx")(made)
    return _CLASSES[key]


def __getattr__(name: str) -> Any:
    if name == "PhaseSchedule":  # the schedule of tf.keras' Keras (schedule_class)
        return schedule_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
