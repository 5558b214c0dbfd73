"""LAMB: Adam with layer-wise adaptive rates (You et al. 2020, Algorithm 2).

    m <- beta_1 m + (1 - beta_1) g;   v <- beta_2 v + (1 - beta_2) g^2
    r = m_hat / (sqrt(v_hat) + epsilon) + weight_decay * w      (m_hat, v_hat bias-corrected)
    trust = ||w|| / ||r||   (1 if either is 0; clipped to [min, max] when given)
    w <- w - learning_rate * trust * r

The same update as tensorflow-addons' LAMB (its tests compare the two).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import tensorflow as tf

from hvdx.comm.traits import OptimizerTraits
from hvdx.optimizers.layerwise import LayerwiseOptimizer, flag, number
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["LAMB"]


@keras2.utils.register_keras_serializable(package="hvdx")
class LAMB(LayerwiseOptimizer):
    """Layer-wise adaptive moments for large batches (tf.keras optimizer, Keras 2 API).

    Args:
      learning_rate: a float >= 0 or a LearningRateSchedule.
      beta_1, beta_2: moment decay rates in [0, 1).
      epsilon: added to sqrt(v_hat) (> 0).
      weight_decay: decoupled weight decay added to the direction (>= 0).
      bias_correction: divide the moments by 1 - beta^t (Algorithm 2) or not.
      exclude_from_weight_decay, exclude_from_layer_adaptation, min_trust_ratio,
      max_trust_ratio, parallel: as for hvdx.optimizers.LARS.
    """

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True, exclude_from_weight_decay=None,
                 exclude_from_layer_adaptation=None, min_trust_ratio: Optional[float] = None,
                 max_trust_ratio: Optional[float] = None, parallel: Optional[str] = None, name: str = "LAMB",
                 **kwargs) -> None:
        super().__init__(name, weight_decay=weight_decay, exclude_from_weight_decay=exclude_from_weight_decay,
                         exclude_from_layer_adaptation=exclude_from_layer_adaptation,
                         min_trust_ratio=min_trust_ratio, max_trust_ratio=max_trust_ratio, parallel=parallel,
                         **kwargs)
        self._check_learning_rate(learning_rate)
        self._learning_rate = self._build_learning_rate(learning_rate)
        self.beta_1 = number(beta_1, "beta_1", 0.0, 1.0, high_open=True)
        self.beta_2 = number(beta_2, "beta_2", 0.0, 1.0, high_open=True)
        self.epsilon = number(epsilon, "epsilon", low_open=True)
        self.bias_correction = flag(bias_correction, "bias_correction")

    def hvdx_traits(self) -> OptimizerTraits:
        """What hvdx's strategies decide their default aids from (`hvdx.comm.traits`): Adam's
        per-coordinate moments, and a trust ratio that measures the update step."""
        return OptimizerTraits(name=type(self).__name__, adaptive=True, trust_ratio="step")

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        self._built = True
        self._m = [self.add_variable_from_reference(v, "m") for v in var_list]
        self._v = [self.add_variable_from_reference(v, "v") for v in var_list]

    def _prepare(self, gradients: List[tf.Tensor], variables: List[Any]) -> List[tf.Tensor]:
        directions = []
        for g, w in zip(gradients, variables):
            dtype = w.dtype
            index = self._index_dict[self._var_key(w)]
            m, v = self._m[index], self._v[index]
            beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
            m.assign(beta_1 * m + (1 - beta_1) * g)
            v.assign(beta_2 * v + (1 - beta_2) * tf.square(g))
            m_hat, v_hat = tf.convert_to_tensor(m), tf.convert_to_tensor(v)
            if self.bias_correction:
                step = tf.cast(self.iterations + 1, dtype)
                m_hat = m_hat / (1 - tf.pow(beta_1, step))
                v_hat = v_hat / (1 - tf.pow(beta_2, step))
            r = m_hat / (tf.sqrt(v_hat) + tf.cast(self.epsilon, dtype))
            if self._decays(w):
                r = r + tf.cast(self.weight_decay, dtype) * w
            directions.append(r)
        return directions

    def _ratio(self, w_norm: tf.Tensor, d_norm: tf.Tensor, decay: tf.Tensor) -> tf.Tensor:
        return w_norm / d_norm

    def _apply(self, gradient: tf.Tensor, direction: tf.Tensor, variable, ratio: tf.Tensor):
        rate = tf.cast(self.learning_rate, variable.dtype) * tf.cast(ratio, variable.dtype)
        return variable.assign_sub(rate * direction)

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter(self._learning_rate), beta_1=self.beta_1,
                      beta_2=self.beta_2, epsilon=self.epsilon, bias_correction=self.bias_correction)
        return config
