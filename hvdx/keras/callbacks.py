"""Horovod's Keras callbacks (`horovod.tensorflow.keras.callbacks`, every public name,
re-exported from it), with hvdx's own for those Horovod's cannot serve, and SwitchCommunication.

Where tf.keras is Keras 2: hvdx's BroadcastGlobalVariablesCallback (Horovod's plus a check
that every rank runs the same number of steps), and Horovod's MetricAverageCallback,
LearningRateScheduleCallback and LearningRateWarmupCallback on tf.keras's backend
(hvdx.keras.horovod_callbacks: Horovod's own fail from TensorFlow 2.16 on); each, and
BestModelCheckpoint, hands a Keras 3 model to its Keras 3 counterpart (`hvdx.callbacks.follow`).
Where tf.keras is Keras 3 (TensorFlow 2.16+ without $TF_USE_LEGACY_KERAS=1), the five are
hvdx.keras.keras3_callbacks' (Horovod's, bound to Keras 3's Callback, fail on every model).
The LR callbacks work with hvdx's optimizer of either Keras, momentum correction included.
"""
import horovod.tensorflow.keras.callbacks as _horovod

from hvdx.callbacks import SwitchCommunication
from hvdx.legacy_keras import tf_keras_is_keras3 as _tf_keras_is_keras3
from hvdx.tensorflow import _horovod_api

if _tf_keras_is_keras3():
    from hvdx.keras.keras3_callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,
                                             LearningRateScheduleCallback, LearningRateWarmupCallback,
                                             MetricAverageCallback)
else:
    from hvdx.callbacks import BroadcastGlobalVariablesCallback
    from hvdx.keras.horovod_callbacks import (BestModelCheckpoint, LearningRateScheduleCallback,
                                              LearningRateWarmupCallback, MetricAverageCallback)

_EXPORTED = _horovod_api.reexport(_horovod, globals(), own=(
    "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "MetricAverageCallback", "SwitchCommunication"))
__getattr__ = _horovod_api.late(_horovod, __name__, exported=_EXPORTED)  # and __all__
