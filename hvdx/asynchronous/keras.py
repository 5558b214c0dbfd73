"""The shared-memory methods' Keras glue: `SharedModelCallback(method)`, hvdx's one method
driver (`hvdx.callbacks.TrainingMethodCallback`) for these methods, whose own `train_step`
replaces Keras' during `fit`.

    model.fit(x_shard, y_shard, epochs=20, callbacks=[hvdx.asynchronous.SharedModelCallback(method)])
"""
from __future__ import annotations

from hvdx.asynchronous.method import SharedModelMethod
from hvdx.callbacks.method import TrainingMethodCallback

__all__ = ["SharedModelCallback"]


class SharedModelCallback(TrainingMethodCallback):
    """`TrainingMethodCallback(method)` for a shared-memory method (AsyncMiniBatch, ASSM,
    PASSM, PASSMPlus): the method's step replaces the model's for the duration of `fit`; at
    every epoch's end (and before validation) the variables hold the node's shared model, so
    callbacks after this one (ModelCheckpoint) save it; at the end of `fit` every rank holds
    the same final model (`finish()`). `stats` holds this rank's record (steps, staleness)
    after `fit`. Every rank must run the same number of steps and epochs (checked).

    Raises: TypeError for a `method` that is no shared-memory method."""

    kind = SharedModelMethod

    def __init__(self, method: SharedModelMethod) -> None:
        if not isinstance(method, SharedModelMethod):
            raise TypeError(f"SharedModelCallback takes an hvdx.asynchronous method (AsyncMiniBatch, ASSM, PASSM, "
                            f"PASSMPlus), got {type(method).__name__}")
        super().__init__(method)
