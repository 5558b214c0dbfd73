"""Horovod's Keras callbacks, with hvdx's BroadcastGlobalVariablesCallback (Horovod's plus
a check that every rank runs the same number of steps) and SwitchCommunication."""
from horovod.tensorflow.keras.callbacks import (BestModelCheckpoint, LearningRateScheduleCallback,
                                                LearningRateWarmupCallback, MetricAverageCallback)

from hvdx.callbacks import BroadcastGlobalVariablesCallback, SwitchCommunication

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback", "SwitchCommunication"]
