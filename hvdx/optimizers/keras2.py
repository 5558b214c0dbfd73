"""hvdx's LARS and LAMB as Keras 2 optimizers (tf.keras where it is Keras 2, else the tf_keras
package: `hvdx.legacy_keras.keras2`), the Keras 2 optimizer API of TensorFlow 2.15.

The rules are Keras-neutral (`hvdx.optimizers.lars.LARSRule`, `lamb.LAMBRule`, on
`layerwise.Layerwise`); this adapter puts them on Keras 2's Optimizer: the step's hook that sees
every variable (`_internal_apply_gradients`, which plans the directions and trust ratios of all
layers at once), the per-variable `update_step`, the slots (`_index_dict`), the learning rate
and the config. Registered with Keras 2 as "hvdx>LARS" and "hvdx>LAMB".
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import tensorflow as tf

from hvdx import legacy_keras
from hvdx.optimizers import lamb, lars
from hvdx.optimizers.layerwise import Layerwise, check_learning_rate, layerwise_options

_keras = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["LAMB", "LARS", "LayerwiseOptimizer"]


class LayerwiseOptimizer(Layerwise, _keras.optimizers.Optimizer):
    """Base of the Keras 2 LARS and LAMB: `hvdx.optimizers.layerwise.Layerwise` on Keras 2's
    Optimizer (Keras' own decoupled weight decay and per-variable XLA off)."""

    def __init__(self, name: str, learning_rate, options: Dict[str, Any], hyper: Dict[str, Any], **kwargs) -> None:
        kwargs.pop("jit_compile", None)  # the rates are computed outside update_step: no per-variable XLA
        learning_rate = check_learning_rate(learning_rate)
        super().__init__(name=name, weight_decay=None, jit_compile=False, **kwargs)
        self._adopt(options, hyper)
        self._learning_rate = self._build_learning_rate(learning_rate)

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        self._built = True
        self._slot_lists(var_list, self.add_variable_from_reference)

    def _slot(self, kind: str, variable):
        return getattr(self, self._SLOTS[kind])[self._index_dict[self._var_key(variable)]]

    def _assign(self, variable, value):
        return variable.assign(value)

    def _assign_sub(self, variable, value):
        return variable.assign_sub(value)

    @tf.autograph.experimental.do_not_convert
    def _internal_apply_gradients(self, grads_and_vars):
        grads_and_vars = [(tf.convert_to_tensor(g), v) for g, v in grads_and_vars]  # IndexedSlices: dense
        self._plan([g for g, _ in grads_and_vars], [v for _, v in grads_and_vars])
        try:
            return super()._internal_apply_gradients(grads_and_vars)
        finally:
            self._unplan()

    @tf.autograph.experimental.do_not_convert
    def update_step(self, gradient, variable):
        return self._update(gradient, variable, self.learning_rate)

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(self._layerwise_config())
        config["learning_rate"] = self._serialize_hyperparameter(self._learning_rate)
        return config


@_keras.utils.register_keras_serializable(package="hvdx")
class LARS(lars.LARSRule, LayerwiseOptimizer):
    __doc__ = "Layer-wise adaptive rate scaling (Keras 2 optimizer: hvdx.optimizers.lars).\n" + lars.ARGS

    momentum_read_by_ops = True  # hvdx.wrapped.MOMENTUM_READ_BY_OPS: a momentum variable works in its step

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


@_keras.utils.register_keras_serializable(package="hvdx")
class LAMB(lamb.LAMBRule, LayerwiseOptimizer):
    __doc__ = "Layer-wise adaptive moments for large batches (Keras 2 optimizer: hvdx.optimizers.lamb).\n" + lamb.ARGS

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
