"""Deep Gradient Compression's convergence aids, as rules the sparse strategies apply.

Deep Gradient Compression: Reducing the Communication Bandwidth for Distributed Training,
Y. Lin, S. Han, H. Mao, Y. Wang, W. J. Dally, ICLR 2018, arXiv:1712.01887 ("DGC").
Top-k with error feedback alone, at 1 % density, learns less per step than dense
averaging; DGC closes the gap with four aids, each one keyword of the sparse strategies
(`hvdx.comm.HiTopK`, `hvdx.comm.SparseAllgather`) and of hvdx's optimizer and tape:

- `momentum=` m, momentum correction (DGC sec. 3.2): the velocity, not the gradient, is
  accumulated locally before sparsification, u <- m u + g, v <- v + u, and top-k selects
  from v; the aggregated update is applied by plain SGD (no second momentum), so what is
  sent is what momentum SGD would have applied.
- `momentum_masking=` (on with momentum), momentum factor masking (DGC sec. 3.3): the
  velocity u of the entries sent is set to zero, so a stale velocity does not keep pushing
  an entry that was already applied.
- `clip_norm=` C, local gradient clipping (DGC sec. 3.2): each rank clips its own gradient
  (the bucket it aggregates) to norm C N^-1/2 before accumulating it, N the number of ranks,
  so that the sum of N independent clipped gradients has the norm a global clip to C gives.
- `warmup_steps=` T with `warmup_density=` rho0, density warm-up (DGC sec. 3.3, "warm-up
  training"): the density falls exponentially from rho0 (default 0.25) to the target over
  `WARMUP_STAGES` equal stages of the first T steps.
- `residual_decay=` beta (error feedback with a decaying memory, as GRACE's residual
  memory with a coefficient; Xu et al., "GRACE: A Compressed Communication Framework for
  Distributed Machine Learning", ICDCS 2021): v <- beta v + g; 1 is plain error feedback.

The functions below are the rules (each checked against a NumPy reference in
`tests/test_dgc.py`); `hvdx.comm.sparse.TopKStrategy` composes them with MSTopK, the
residual memory and the exchange. Under HiTopK they act on the node's slice after the
node-local reduce-scatter: the velocity of a node's summed gradient is the sum of its
ranks' velocities (the rule is linear), and the mask is the node's selection.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from hvdx import ops
from hvdx.arguments import integer, is_integer, real

__all__ = ["DensityWarmup", "WARMUP_STAGES", "accumulate", "check_aids", "local_clip", "mask_velocity"]

_EPSILON = 1e-7  # Keras' backend.epsilon(): no norm divides by less

#: How many densities the warm-up steps through (DGC's ImageNet schedule: 4 epochs,
#: 25 % -> 6.25 % -> 1.5625 % -> 0.4 % before 0.1 %).
WARMUP_STAGES = 4


def local_clip(grad: tf.Tensor, clip_norm: float, num_ranks: int, scale: Optional[tf.Tensor] = None) -> tf.Tensor:
    """DGC's local gradient clipping: `grad` scaled to norm at most C N^-1/2.

    Args:
      grad: this rank's 1-D gradient buffer (float32).
      clip_norm: C, the threshold a global clip of the averaged gradient would use.
      num_ranks: N, the ranks whose clipped gradients are added.
      scale: the loss scale the gradients carry (custom loops with `loss_scale=`): the
        threshold is multiplied by it; None: 1.
    Returns:
      grad * min(1, C N^-1/2 / ||grad||). A non-finite norm gives non-finite entries
      (0 * Inf), so the step stays non-finite for the loss scaler.
    """
    threshold = tf.constant(clip_norm / math.sqrt(num_ranks), grad.dtype)
    if scale is not None:
        threshold = threshold * tf.cast(scale, grad.dtype)
    norm = tf.norm(grad)
    return grad * tf.minimum(tf.ones([], grad.dtype), threshold / tf.maximum(norm, _EPSILON))


def accumulate(grads: Sequence[tf.Tensor], residual: tf.Tensor, velocity: Optional[tf.Tensor], momentum: float,
               decay: float) -> Tuple[tf.Tensor, Optional[tf.Tensor]]:
    """DGC's momentum correction (and error feedback's decay): what top-k selects from, in one
    pass over the buffer (`hvdx.ops.error_feedback`).

    Args:
      grads: this step's (clipped) gradient g, as one or more 1-D float32 tensors added in
        order (a node's parts after its reduce-scatter).
      residual: v, what was accumulated and not sent.
      velocity: u, the local velocity (None without momentum correction).
      momentum: m (0: no momentum correction).
      decay: beta, the residual's decay (1: plain error feedback).
    Returns:
      (v', u') with u' = m u + g and v' = beta v + u' (momentum), or v' = beta v + g and
      u' = None (without).
    """
    if velocity is None or momentum == 0.0:
        velocity = None
    return ops.error_feedback(grads, residual, velocity, momentum=momentum, decay=decay)


def mask_velocity(velocity: tf.Tensor, indices: tf.Tensor, keep: Optional[Sequence[int]] = None) -> tf.Tensor:
    """DGC's momentum factor masking: `velocity` with the entries at `indices` (those sent,
    distinct, as MSTopK's are) set to zero, except those listed in `keep` (ascending: the
    entries sent whole every step, whose momentum runs on).

    The entries are zeroed by adding their negation (`hvdx.ops.sparse_accumulate`), in place
    where nothing else holds `velocity`: O(k), not a pass over the buffer. (A non-finite
    entry becomes NaN instead of 0; such a step is not committed.)"""
    values = -tf.gather(velocity, indices)
    if keep:
        kept = tf.constant(keep, indices.dtype)
        at = tf.minimum(tf.searchsorted(kept, indices), len(keep) - 1)
        values = tf.where(tf.equal(tf.gather(kept, at), indices), tf.zeros_like(values), values)
    return ops.sparse_accumulate(values, indices, int(velocity.shape[0]), out=velocity)


@dataclass(frozen=True)
class DensityWarmup:
    """DGC's density warm-up: stage i < S of the first `steps` steps uses density
    rho0 (rho/rho0)^(i/S); from step `steps` on, rho. Stages are `steps / S` steps long
    (the last takes the remainder)."""

    start: float
    target: float
    steps: int
    stages: int = WARMUP_STAGES

    def densities(self) -> List[float]:
        """The density of each stage, then the target: S + 1 values."""
        ratio = self.target / self.start
        return [self.start * ratio ** (i / self.stages) for i in range(self.stages)] + [self.target]

    def stage(self, step: Any) -> Any:
        """The stage (an index into `densities`) of a step: int for an int, int32 tensor for a tensor."""
        length = max(1, self.steps // self.stages)
        if is_integer(step):
            return self.stages if step >= self.steps else min(step // length, self.stages - 1)
        step = tf.cast(step, tf.int64)
        during = tf.minimum(step // length, self.stages - 1)
        return tf.cast(tf.where(step >= self.steps, tf.constant(self.stages, tf.int64), during), tf.int32)

    def density(self, step: int) -> float:
        """The density used at `step` (Python int)."""
        return self.densities()[self.stage(step)]


def check_aids(momentum: float, momentum_masking: bool, clip_norm: Optional[float], warmup_steps: int,
               warmup_density: float, residual_decay: float, density: float) -> None:
    """Validates the aids' options once, at construction (ValueError naming the fix)."""
    real(momentum, "momentum (DGC's momentum correction)", 0, 1, high_open=True,
         expected="a number in [0, 1) (0 turns it off)")
    if not isinstance(momentum_masking, bool):
        raise ValueError(f"momentum_masking must be True or False, got {momentum_masking!r}")
    real(clip_norm, "clip_norm", 0, low_open=True, optional=True,
         expected="a positive number or None (no clipping)")
    integer(warmup_steps, "warmup_steps", 0, expected="an int >= 0 (0: no density warm-up)")
    warmup_density = real(warmup_density, "warmup_density", 0, 1, low_open=True, expected="a number in (0, 1]")
    if warmup_steps and warmup_density < density:
        raise ValueError(f"warmup_density={warmup_density} is below density={density}: the warm-up starts "
                         "denser than the target (DGC: 0.25)")
    real(residual_decay, "residual_decay", 0, 1, low_open=True,
         expected="a number in (0, 1] (1: plain error feedback)")
