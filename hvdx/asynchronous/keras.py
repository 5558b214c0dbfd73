"""The shared-memory methods' Keras glue is hvdx's one method driver (`hvdx.callbacks.method`:
`SharedModelCallback(method)` is `TrainingMethodCallback(method)` for these methods, whose
own `train_step` replaces Keras' during `fit`); this name stays for the code that imported it
from here.

    model.fit(x_shard, y_shard, epochs=20, callbacks=[hvdx.asynchronous.SharedModelCallback(method)])
"""
from hvdx.callbacks.method import SharedModelCallback

__all__ = ["SharedModelCallback"]
