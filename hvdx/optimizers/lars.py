"""LARS: momentum SGD with layer-wise adaptive rates (You et al. 2017; shi2021 eq. 11).

Each layer l gets the local rate (eq. 11, gamma = `eeta`, epsilon of the paper = the weight
decay, plus a numerical `epsilon`)

    trust = eeta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)      (1 if ||w|| or ||g|| is 0)
    v <- momentum * v + learning_rate * trust * (g + weight_decay * w);   w <- w - v

("classic" momentum, as TensorFlow's TPU reference LARS and the DAWNBench recipes). With
classic_momentum=False the momentum is applied first and the trust ratio measures the step
instead (SimCLR's variant): v <- momentum * v + g + wd w, u = v (Nesterov: momentum v + g +
wd w), trust = eeta ||w|| / (||u|| + epsilon), w <- w - learning_rate * trust * u.

Under a sparse strategy (top-k with error feedback), the trust ratio is applied before the
strategy instead, on each rank's own gradient ("local trust ratio", `local_trusted`):

    d_i = trust (g_i + weight_decay * w),  trust = eq. 11 with ||mean_i g_i|| estimated
          from an allreduced CountSketch (sketch.py; norms="rank": rank i's own ||g_i||)
    (with momentum correction) u_i <- momentum u_i + d_i,  sparsified, averaged: U
    v <- learning_rate * U;  w <- w - v          (`trust_applied`: ratio 1, no decay here)

so the velocity the strategy accumulates is classic LARS' v / learning_rate, and the step
has classic LARS' size (with each rank's own norm it is smaller where the ranks' gradients
are noise: by up to sqrt(N) on N ranks). Measured on the aggregated sparse update instead, eq. 11 would
normalise away what error feedback accumulated (each entry is sent about once every
1/density steps, with that many steps' gradients in it, and the trust ratio divides it
back to one step's norm: about sqrt(density) of LARS' progress per entry) and, with the
momentum moved into the strategy, the accumulated velocity (another factor 1 - momentum).

This module holds the rule, Keras-neutral (`LARSRule`, on `layerwise.Layerwise`); the
optimizers are `hvdx.optimizers.keras2.LARS` (Keras 2 / tf_keras) and
`hvdx.optimizers.keras3.LARS` (Keras 3); `hvdx.optimizers.LARS` is tf.keras's Keras' one.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List, Optional

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx.comm.traits import OptimizerTraits, plain_number
from hvdx.optimizers import sketch
from hvdx.optimizers.layerwise import Layerwise, flag, number
from hvdx.variables import tf_variable

__all__ = ["LARSRule", "NORMS", "lars_options"]

#: What `LARS.local_trusted` measures ||g|| of eq. 11 on: the ranks' average (sketched) or this rank's own.
NORMS = ("average", "rank")

#: The LARS docstring's Args, shared by both Keras' classes.
ARGS = """
    Args:
      learning_rate: eta_t, a float >= 0 or a LearningRateSchedule.
      momentum: in [0, 1).
      weight_decay: L2 weight decay (>= 0), added to the gradient and to eq. 11's denominator.
      eeta: the trust coefficient gamma of eq. 11 (> 0).
      epsilon: added to the denominator (>= 0).
      nesterov: Nesterov momentum (True or False).
      classic_momentum: trust ratio from the gradient (True, eq. 11) or from the momentum
        step (False).
      exclude_from_weight_decay: regex patterns (a string is one pattern) of variable names
        that get no weight decay, e.g. ["bias", "batch_normalization", "_bn/"].
      exclude_from_layer_adaptation: patterns of variables whose trust ratio is 1 (default:
        exclude_from_weight_decay's).
      min_trust_ratio, max_trust_ratio: clip the trust ratio (e.g. 1e-5 and 1.0).
      parallel: None (replicated, fused), "pto" or "slices": see hvdx.optimizers.layerwise.
"""


def lars_options(*, momentum: float, eeta: float, epsilon: float, nesterov: bool,
                 classic_momentum: bool) -> Dict[str, Any]:
    """LARS' own hyper-parameters, checked (ValueError naming the argument)."""
    return dict(momentum=number(momentum, "momentum", 0.0, 1.0, high_open=True),
                eeta=number(eeta, "eeta", low_open=True), epsilon=number(epsilon, "epsilon"),
                nesterov=flag(nesterov, "nesterov"), classic_momentum=flag(classic_momentum, "classic_momentum"))


class LARSRule(Layerwise):
    """LARS' update rule (module docstring), for either Keras: the adapters put it on their
    Optimizer (`hvdx.optimizers.keras2.LARS`, `hvdx.optimizers.keras3.LARS`). Its momentum is
    a Python number the step reads when traced (the wrapper sets it to 0 there under momentum
    correction)."""

    _SLOTS = {"m": "momentums"}

    def hvdx_traits(self) -> OptimizerTraits:
        """What hvdx's strategies decide their default aids from (`hvdx.comm.traits`): momentum
        (a number the wrapper can set to 0 in the step), Nesterov's or not, and a trust ratio
        that measures the gradient (classic momentum: eq. 11 can go before aggregation,
        `local_trusted`) or the momentum step."""
        return OptimizerTraits(name=type(self).__name__, momentum=plain_number(self.momentum), nesterov=self.nesterov,
                               trust_ratio="gradient" if self.classic_momentum else "step")

    def local_trusted(self, gradients: List[Optional[tf.Tensor]], variables: List[Any], norms: str = "average",
                      process_set: Optional[hvd.ProcessSet] = None,
                      width: int = sketch.DEFAULT_WIDTH) -> List[Optional[tf.Tensor]]:
        """Eq. 11's layer-wise rate applied to this rank's own gradients, before aggregation:
        trust_l (g_l + weight_decay w_l) per variable (trust 1 for layers excluded from
        adaptation, clipped as configured); None stays None, sparse gradients are densified.
        What hvdx.DistributedOptimizer sends through a sparse strategy with
        local_trust_ratio=True; the step then applies the aggregate inside `trust_applied()`.

        Args:
          norms: "average": ||g_l|| of eq. 11 is the norm of the gradients averaged over
            `process_set`, estimated from an allreduce of their CountSketches (sketch.py,
            `width` buckets per layer; exact for layers of at most `width` entries): every rank
            of the set must call this, in the same order; "rank": this rank's own ||g_l||.
          process_set: the ranks the gradients will be averaged over (None: all).
          width: the sketch's buckets per layer.

        Raises:
          ValueError: with classic_momentum=False (its trust ratio measures the momentum step,
            which does not exist before aggregation); norms not "average" or "rank".
        """
        if not self.classic_momentum:
            raise ValueError("the local trust ratio scales each rank's gradient by eq. 11 before aggregation; "
                             "LARS(classic_momentum=False) measures the momentum step instead: use "
                             "classic_momentum=True, or local_trust_ratio=False")
        if norms not in NORMS:
            raise ValueError(f"norms must be one of {', '.join(map(repr, NORMS))}, got {norms!r}")
        present = [i for i, g in enumerate(gradients) if g is not None]
        out = list(gradients)
        if not present:
            return out
        grads = [tf.convert_to_tensor(gradients[i]) for i in present]
        chosen = [variables[i] for i in present]
        averaged = None
        if norms == "average":
            process_set = process_set or hvd.global_process_set
            averaged = functools.partial(sketch.averaged_squared_norms, width=width, allreduce=functools.partial(
                hvd.allreduce, op=hvd.Average, process_set=process_set, name="hvdx.lars.trust_sketch"))
        ratios = self.trust_ratios(chosen, grads, mode=None, direction_squares=averaged)
        for i, g, w, r in zip(present, grads, chosen, ratios):
            out[i] = tf.cast(r, g.dtype) * self._decayed(g, w)
        return out

    @contextlib.contextmanager
    def trust_applied(self, on: bool = True) -> Iterator[None]:
        """Inside (while a step is traced), the gradients are taken as `local_trusted`'s
        aggregate: the step applies them with ratio 1 and no weight decay of its own (both are
        in them already), v <- momentum v + learning_rate g; w <- w - v."""
        before = self._book.trust_applied
        self._book.trust_applied = bool(on)
        try:
            yield
        finally:
            self._book.trust_applied = before

    def _decayed(self, gradient: tf.Tensor, variable) -> tf.Tensor:
        if not self._decays(variable) or self._book.trust_applied:
            return gradient
        value = tf.convert_to_tensor(tf_variable(variable))
        return gradient + tf.cast(self.weight_decay, value.dtype) * value

    def _prepare(self, gradients: List[tf.Tensor], variables: List[Any]) -> List[tf.Tensor]:
        if self.classic_momentum:  # eq. 11 measures the gradient itself
            return list(gradients)
        steps = []
        for g, v in zip(gradients, variables):
            g = self._decayed(g, v)
            m = self._slot("m", v)
            momentum = tf.cast(self.momentum, tf.as_dtype(v.dtype))
            self._assign(m, momentum * tf.convert_to_tensor(tf_variable(m)) + g)
            m = tf.convert_to_tensor(tf_variable(m))
            steps.append(momentum * m + g if self.nesterov else m)
        return steps

    def _ratio(self, w_norm: tf.Tensor, d_norm: tf.Tensor, decay: tf.Tensor) -> tf.Tensor:
        if self.classic_momentum:
            return self.eeta * w_norm / (d_norm + decay * w_norm + self.epsilon)
        return self.eeta * w_norm / (d_norm + self.epsilon)

    def _apply(self, gradient: tf.Tensor, direction: tf.Tensor, variable, ratio: tf.Tensor, learning_rate):
        dtype = tf.as_dtype(variable.dtype)
        rate = tf.cast(learning_rate, dtype) * tf.cast(ratio, dtype)
        if self.classic_momentum:  # one fused kernel: accum = momentum accum - rate g; w += accum
            return tf.raw_ops.ResourceApplyKerasMomentum(
                var=tf_variable(variable).handle, accum=tf_variable(self._slot("m", variable)).handle, lr=rate,
                grad=self._decayed(gradient, variable), momentum=tf.cast(self.momentum, dtype),
                use_nesterov=self.nesterov)
        return self._assign_sub(variable, rate * direction)

    def _rule_config(self) -> Dict[str, Any]:
        return dict(momentum=self.momentum, eeta=self.eeta, epsilon=self.epsilon, nesterov=self.nesterov,
                    classic_momentum=self.classic_momentum)
