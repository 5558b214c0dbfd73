"""hvdx's LARS and LAMB as Keras 3 optimizers (`import keras`, or tf.keras where it is Keras 3),
on the TensorFlow backend.

    import hvdx, keras
    from hvdx.optimizers.keras3 import LARS     # hvdx.optimizers.LARS where tf.keras is Keras 3
    opt = hvdx.DistributedOptimizer(LARS(0.1, weight_decay=5e-4, parallel="slices"), communication="hitopk")
    model.compile(optimizer=opt, loss=...)      # a Keras 3 model

The rules are Keras-neutral (`hvdx.optimizers.lars.LARSRule`, `lamb.LAMBRule`, on
`layerwise.Layerwise`: the same formulas, options, `parallel=` modes and hooks of
hvdx.DistributedOptimizer as the Keras 2 classes, `hvdx.optimizers.keras2`); this adapter puts
them on Keras 3's Optimizer: the step's hook that sees every variable (`_backend_update_step`,
which plans the directions and trust ratios of all layers at once, with the Keras 3 variables
and their paths), the per-variable `update_step(gradient, variable, learning_rate)`, the slots
(`_get_variable_index`), the assignments (`assign`, `assign_sub`) and the config. Registered
with Keras 3 as "hvdx>Keras3LARS" and "hvdx>Keras3LAMB" (Keras 2's are "hvdx>LARS", "hvdx>LAMB").

Keras 3's own options (clipnorm, use_ema, gradient_accumulation_steps, loss_scale_factor, ...)
are taken as by its other optimizers; its decoupled `weight_decay` is not (the rule's
weight_decay= is LARS' and LAMB's). The momentum is a Python number that the step reads when it
is traced, as Keras 3's SGD's (hvdx.DistributedOptimizer sets it to 0 there under momentum
correction).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import keras
import tensorflow as tf

from hvdx.optimizers import lamb, lars
from hvdx.optimizers.layerwise import Layerwise, check_learning_rate, layerwise_options

__all__ = ["LAMB", "LARS", "LayerwiseOptimizer"]

if int(keras.__version__.split(".")[0]) < 3:
    raise ImportError(f"hvdx.optimizers.keras3 holds Keras 3 optimizers; the keras package here is {keras.__version__} "
                      "(TensorFlow 2.15's Keras 2): use hvdx.optimizers.keras2's LARS and LAMB")


class LayerwiseOptimizer(Layerwise, keras.optimizers.Optimizer):
    """Base of the Keras 3 LARS and LAMB: `hvdx.optimizers.layerwise.Layerwise` on Keras 3's
    Optimizer (its decoupled weight decay off).

    Raises:
      ValueError: a bad argument, naming it (as the Keras 2 classes); a Keras 3 backend other
        than TensorFlow (the norms and the collectives are TensorFlow's and Horovod's).
    """

    def __init__(self, name: str, learning_rate, options: Dict[str, Any], hyper: Dict[str, Any], **kwargs) -> None:
        if keras.backend.backend() != "tensorflow":
            raise ValueError(f"hvdx's {type(self).__name__} runs on Keras 3's TensorFlow backend, not on "
                             f"{keras.backend.backend()!r}: set KERAS_BACKEND=tensorflow")
        learning_rate = check_learning_rate(learning_rate)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self._adopt(options, hyper)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._slot_lists(var_list, self.add_variable_from_reference)

    def _slot(self, kind: str, variable):
        return getattr(self, self._SLOTS[kind])[self._get_variable_index(variable)]

    def _assign(self, variable, value):
        self.assign(variable, value)

    def _assign_sub(self, variable, value):
        self.assign_sub(variable, value)

    @tf.autograph.experimental.do_not_convert
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices: dense
        self._plan(grads, trainable_variables)  # the Keras 3 variables (their paths name them)
        try:
            super()._backend_update_step(grads, trainable_variables, learning_rate)
        finally:
            self._unplan()

    @tf.autograph.experimental.do_not_convert
    def update_step(self, gradient, variable, learning_rate):
        # Keras' TensorFlow backend hands over the tf.Variable behind the Keras 3 variable: the
        # Keras 3 one again, so that the rule sees the variables it planned with (names, patterns)
        self._update(gradient, self._trainable_variables[self._get_variable_index(variable)], learning_rate)

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(self._layerwise_config())
        return config


@keras.saving.register_keras_serializable(package="hvdx", name="Keras3LARS")
class LARS(lars.LARSRule, LayerwiseOptimizer):
    __doc__ = "Layer-wise adaptive rate scaling (Keras 3 optimizer: hvdx.optimizers.lars).\n" + lars.ARGS

    def __init__(self, learning_rate=0.1, momentum: float = 0.9, weight_decay: float = 1e-4, eeta: float = 0.001,
                 epsilon: float = 0.0, nesterov: bool = False, classic_momentum: bool = True,
                 exclude_from_weight_decay=None, exclude_from_layer_adaptation=None,
                 min_trust_ratio: Optional[float] = None, max_trust_ratio: Optional[float] = None,
                 parallel: Optional[str] = None, name: str = "LARS", **kwargs) -> None:
        options = layerwise_options(weight_decay=weight_decay, exclude_from_weight_decay=exclude_from_weight_decay,
                                    exclude_from_layer_adaptation=exclude_from_layer_adaptation,
                                    min_trust_ratio=min_trust_ratio, max_trust_ratio=max_trust_ratio,
                                    parallel=parallel)
        hyper = lars.lars_options(momentum=momentum, eeta=eeta, epsilon=epsilon, nesterov=nesterov,
                                  classic_momentum=classic_momentum)
        super().__init__(name, learning_rate, options, hyper, **kwargs)


@keras.saving.register_keras_serializable(package="hvdx", name="Keras3LAMB")
class LAMB(lamb.LAMBRule, LayerwiseOptimizer):
    __doc__ = "Layer-wise adaptive moments for large batches (Keras 3 optimizer: hvdx.optimizers.lamb).\n" + lamb.ARGS

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True, exclude_from_weight_decay=None,
                 exclude_from_layer_adaptation=None, min_trust_ratio: Optional[float] = None,
                 max_trust_ratio: Optional[float] = None, parallel: Optional[str] = None, name: str = "LAMB",
                 **kwargs) -> None:
        options = layerwise_options(weight_decay=weight_decay, exclude_from_weight_decay=exclude_from_weight_decay,
                                    exclude_from_layer_adaptation=exclude_from_layer_adaptation,
                                    min_trust_ratio=min_trust_ratio, max_trust_ratio=max_trust_ratio,
                                    parallel=parallel)
        hyper = lamb.lamb_options(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, bias_correction=bias_correction)
        super().__init__(name, learning_rate, options, hyper, **kwargs)
