"""Horovod's Keras callbacks (`horovod.tensorflow.keras.callbacks`, every public name,
re-exported from it), with hvdx's BroadcastGlobalVariablesCallback (Horovod's plus a check
that every rank runs the same number of steps) and SwitchCommunication. Horovod's LR
callbacks work with hvdx's optimizer, momentum correction included (the wrapper's
`momentum` is a variable, hvdx.wrapped.Momentum).
"""
import horovod.tensorflow.keras.callbacks as _horovod

from hvdx.callbacks import BroadcastGlobalVariablesCallback, SwitchCommunication
from hvdx.tensorflow import _horovod_api

_EXPORTED = _horovod_api.reexport(_horovod, globals(), own=("BroadcastGlobalVariablesCallback", "SwitchCommunication"))
__getattr__ = _horovod_api.late(_horovod, __name__, exported=_EXPORTED)  # and __all__
