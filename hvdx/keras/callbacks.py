"""Horovod's Keras callbacks (`horovod.tensorflow.keras.callbacks`, every public name,
re-exported from it), with hvdx's BroadcastGlobalVariablesCallback (Horovod's plus a check
that every rank runs the same number of steps), SwitchCommunication, and Horovod's
MetricAverageCallback, LearningRateScheduleCallback and LearningRateWarmupCallback on
tf.keras's backend (hvdx.keras.horovod_callbacks: Horovod's own fail from TensorFlow 2.16
on). The LR callbacks work with hvdx's optimizer, momentum correction included (the
wrapper's `momentum` is a variable, hvdx.wrapped.Momentum).
"""
import horovod.tensorflow.keras.callbacks as _horovod

from hvdx.callbacks import BroadcastGlobalVariablesCallback, SwitchCommunication
from hvdx.keras.horovod_callbacks import LearningRateScheduleCallback, LearningRateWarmupCallback, MetricAverageCallback
from hvdx.tensorflow import _horovod_api

_EXPORTED = _horovod_api.reexport(_horovod, globals(), own=(
    "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback", "LearningRateWarmupCallback",
    "MetricAverageCallback", "SwitchCommunication"))
__getattr__ = _horovod_api.late(_horovod, __name__, exported=_EXPORTED)  # and __all__
