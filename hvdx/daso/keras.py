"""DASO's Keras glue is hvdx's one method driver (`hvdx.callbacks.method`: `DASOCallback` is
`TrainingMethodCallback` for the model's hvdx.DASO); these names stay for the code that
imported them from here.

    model.fit(..., callbacks=[hvdx.daso.DASOCallback()])
"""
from hvdx.callbacks.method import DASOCallback
from hvdx.daso.optimizer import find_daso

__all__ = ["DASOCallback", "find_daso"]
