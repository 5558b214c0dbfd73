"""LAMB: Adam with layer-wise adaptive rates (You et al. 2020, Algorithm 2).

    m <- beta_1 m + (1 - beta_1) g;   v <- beta_2 v + (1 - beta_2) g^2
    r = m_hat / (sqrt(v_hat) + epsilon) + weight_decay * w      (m_hat, v_hat bias-corrected)
    trust = ||w|| / ||r||   (1 if either is 0; clipped to [min, max] when given)
    w <- w - learning_rate * trust * r

The same update as tensorflow-addons' LAMB (its tests compare the two).

This module holds the rule, Keras-neutral (`LAMBRule`, on `layerwise.Layerwise`); the
optimizers are `hvdx.optimizers.keras2.LAMB` (Keras 2 / tf_keras) and
`hvdx.optimizers.keras3.LAMB` (Keras 3); `hvdx.optimizers.LAMB` is tf.keras's Keras' one.
"""
from __future__ import annotations

from typing import Any, Dict, List

import tensorflow as tf

from hvdx.comm.traits import OptimizerTraits
from hvdx.optimizers.layerwise import Layerwise, flag, number
from hvdx.variables import tf_variable

__all__ = ["LAMBRule", "lamb_options"]

#: The LAMB docstring's Args, shared by both Keras' classes.
ARGS = """
    Args:
      learning_rate: a float >= 0 or a LearningRateSchedule.
      beta_1, beta_2: moment decay rates in [0, 1).
      epsilon: added to sqrt(v_hat) (> 0).
      weight_decay: decoupled weight decay added to the direction (>= 0).
      bias_correction: divide the moments by 1 - beta^t (Algorithm 2) or not.
      exclude_from_weight_decay, exclude_from_layer_adaptation, min_trust_ratio,
      max_trust_ratio, parallel: as for hvdx.optimizers.LARS.
"""


def lamb_options(*, beta_1: float, beta_2: float, epsilon: float, bias_correction: bool) -> Dict[str, Any]:
    """LAMB's own hyper-parameters, checked (ValueError naming the argument)."""
    return dict(beta_1=number(beta_1, "beta_1", 0.0, 1.0, high_open=True),
                beta_2=number(beta_2, "beta_2", 0.0, 1.0, high_open=True),
                epsilon=number(epsilon, "epsilon", low_open=True),
                bias_correction=flag(bias_correction, "bias_correction"))


class LAMBRule(Layerwise):
    """LAMB's update rule (module docstring), for either Keras: the adapters put it on their
    Optimizer (`hvdx.optimizers.keras2.LAMB`, `hvdx.optimizers.keras3.LAMB`)."""

    _SLOTS = {"m": "_m", "v": "_v"}

    def hvdx_traits(self) -> OptimizerTraits:
        """What hvdx's strategies decide their default aids from (`hvdx.comm.traits`): Adam's
        per-coordinate moments, and a trust ratio that measures the update step."""
        return OptimizerTraits(name=type(self).__name__, adaptive=True, trust_ratio="step")

    def _prepare(self, gradients: List[tf.Tensor], variables: List[Any]) -> List[tf.Tensor]:
        directions = []
        for g, w in zip(gradients, variables):
            dtype = tf.as_dtype(w.dtype)
            m, v = self._slot("m", w), self._slot("v", w)
            beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
            self._assign(m, beta_1 * _read(m) + (1 - beta_1) * g)
            self._assign(v, beta_2 * _read(v) + (1 - beta_2) * tf.square(g))
            m_hat, v_hat = _read(m), _read(v)
            if self.bias_correction:
                step = tf.cast(self.iterations + 1, dtype)
                m_hat = m_hat / (1 - tf.pow(beta_1, step))
                v_hat = v_hat / (1 - tf.pow(beta_2, step))
            r = m_hat / (tf.sqrt(v_hat) + tf.cast(self.epsilon, dtype))
            if self._decays(w):
                r = r + tf.cast(self.weight_decay, dtype) * _read(w)
            directions.append(r)
        return directions

    def _ratio(self, w_norm: tf.Tensor, d_norm: tf.Tensor, decay: tf.Tensor) -> tf.Tensor:
        return w_norm / d_norm

    def _apply(self, gradient: tf.Tensor, direction: tf.Tensor, variable, ratio: tf.Tensor, learning_rate):
        dtype = tf.as_dtype(variable.dtype)
        rate = tf.cast(learning_rate, dtype) * tf.cast(ratio, dtype)
        return self._assign_sub(variable, rate * direction)

    def _rule_config(self) -> Dict[str, Any]:
        return dict(beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon,
                    bias_correction=self.bias_correction)


def _read(variable) -> tf.Tensor:
    """A variable of either Keras read as a tensor."""
    return tf.convert_to_tensor(tf_variable(variable))
