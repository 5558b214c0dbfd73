"""Horovod's Keras callbacks that work through a Keras backend module, bound to tf.keras's.

Horovod 0.28.1 hands these callbacks the standalone `keras.backend` (`from keras import
backend as K`), which is tf.keras's backend up to TensorFlow 2.15 and Keras 3's from 2.16
on, where tf.keras is tf_keras (hvdx.legacy_keras) and Keras 3's backend has none of
get_value, set_value, constant, name_scope or get_session: Horovod's MetricAverageCallback,
LearningRateScheduleCallback and LearningRateWarmupCallback fail there at their first
epoch. These subclasses are Horovod's classes, arguments and behaviour unchanged, with
`backend` rebound to `tf.keras.backend` (the same module up to 2.15): isinstance checks
against Horovod's classes hold. Each (and Horovod's BestModelCheckpoint) follows the model it
is given: a Keras 3 model gets hvdx.keras.keras3_callbacks' class (`hvdx.callbacks.follow`).
"""
from __future__ import annotations

import horovod.tensorflow.keras.callbacks as _horovod
import tensorflow as tf

from hvdx.callbacks.follow import follows
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["BestModelCheckpoint", "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback"]


class _TFKerasBackend:
    """Mixin placed before a Horovod callback: after Horovod's __init__ (which stores the
    standalone Keras backend it was given), `self.backend` is tf.keras's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.backend = keras2.backend


class _MetricAverage(_TFKerasBackend, _horovod.MetricAverageCallback):
    """Horovod's MetricAverageCallback (averages the epoch's logs over the ranks) on
    tf.keras's backend. Args as Horovod's: `device`."""


class _LearningRateSchedule(_TFKerasBackend, _horovod.LearningRateScheduleCallback):
    """Horovod's LearningRateScheduleCallback (`initial_lr * multiplier(epoch)` between
    `start_epoch` and `end_epoch`, with momentum correction) on tf.keras's backend. Args as
    Horovod's."""


class _LearningRateWarmup(_TFKerasBackend, _horovod.LearningRateWarmupCallback):
    """Horovod's LearningRateWarmupCallback (Goyal et al. 2017's gradual warm-up from
    `initial_lr / size` to `initial_lr` over `warmup_epochs`) on tf.keras's backend. Args
    as Horovod's."""


_KERAS3 = "hvdx.keras.keras3_callbacks:"
# Each follows the model it is given: a Keras 3 one goes to hvdx.keras.keras3_callbacks' class.
MetricAverageCallback = follows(_MetricAverage, _KERAS3 + "MetricAverageCallback", hooks=("on_epoch_end",))
LearningRateScheduleCallback = follows(_LearningRateSchedule, _KERAS3 + "LearningRateScheduleCallback",
                                       hooks=("on_train_begin", "on_epoch_begin", "on_train_batch_begin"))
LearningRateWarmupCallback = follows(_LearningRateWarmup, _KERAS3 + "LearningRateWarmupCallback",
                                     hooks=("on_train_begin", "on_epoch_begin", "on_train_batch_begin",
                                            "on_epoch_end"))
BestModelCheckpoint = follows(_horovod.BestModelCheckpoint, _KERAS3 + "BestModelCheckpoint",
                              hooks=("on_train_begin",))
