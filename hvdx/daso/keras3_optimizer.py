"""hvdx.DASO on Keras 3: the Keras 3 adapter of DASO (hvdx.daso.method.DASOMethod on
hvdx's Keras 3 optimizer wrapper, hvdx.keras3_optimizer.DistributedOptimizer).

    import hvdx, keras
    hvdx.init()
    opt = hvdx.DASO(keras.optimizers.SGD(0.1, momentum=0.9), total_epochs=20)   # this class
    model.compile(optimizer=opt, loss=...)                                      # a Keras 3 model
    model.fit(x, y, epochs=20, callbacks=[hvdx.daso.DASOCallback()])

`hvdx.DASO` hands a Keras 3 optimizer here; the method, its arguments, schedule, checks and
lifecycle are `hvdx.DASO`'s (hvdx/daso/optimizer.py, docs/daso.md). What is Keras 3's: the
step's entry point (`apply`, which Keras 3's `fit` and `apply_gradients` call), the node-local
aggregation of the Keras 3 wrapper (mixed precision: its LossScaleOptimizer goes inside, made
so under the mixed_float16 policy, and each node's ranks agree on finiteness, so a loss scale
is the node's), its registration and config ("hvdx>DASO" in Keras 3's registry, the wrapped
optimizer through Keras 3's serialisation) and the schedule in a `.keras` archive.
"""
from __future__ import annotations

import copy
from typing import Any, Dict

import keras
import tensorflow as tf

from hvdx.daso.method import DASOMethod
from hvdx.keras3_optimizer import DistributedOptimizer

__all__ = ["DASO"]


@keras.saving.register_keras_serializable(package="hvdx")
class DASO(DASOMethod, DistributedOptimizer):
    """`hvdx.DASO` around a Keras 3 optimizer (`hvdx.DASO(keras.optimizers.SGD(...), ...)` makes
    it); an instance of the wrapped optimizer's class and of `hvdx.daso.DASOMethod`. Arguments,
    behaviour and errors: `hvdx.daso.optimizer.DASO`."""

    def __init__(self, optimizer, *args: Any, **kwargs: Any) -> None:
        self._construct(DistributedOptimizer, optimizer, *args, **kwargs)

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """Keras 3's step: the node-local aggregation and the update under DASO's guard
        (`DASOMethod._guarded_step`); gradients that are None are left out with their variables."""
        grads = list(grads)
        if trainable_variables is None:
            return DistributedOptimizer.apply(self, grads, None)  # refused unbuilt, as Keras' own
        pairs = [(g, v) for g, v in zip(grads, list(trainable_variables)) if g is not None]
        variables = [v for _, v in pairs]
        return self._guarded_step(variables, lambda: DistributedOptimizer.apply(self, [g for g, _ in pairs],
                                                                                variables))

    # -- saving ------------------------------------------------------------------------
    def save_own_variables(self, store) -> None:
        DistributedOptimizer.save_own_variables(self, store)
        self._save_schedule(store)

    def load_own_variables(self, store) -> None:
        DistributedOptimizer.load_own_variables(self, self._load_schedule(store))

    def get_config(self) -> Dict[str, Any]:
        return {"optimizer": keras.saving.serialize_keras_object(self.inner_optimizer), "name": self.name,
                **self._method_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = copy.deepcopy(dict(config))
        optimizer = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        return cls(optimizer, **config)
