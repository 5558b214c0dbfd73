"""Local gradient accumulation over several backward passes (Horovod's
`backward_passes_per_step`): gradients are summed locally for N passes and aggregated
across ranks once, on the N-th; the wrapped optimizer applies them only then.

Passes in between return zeros (identical on every rank, so a loss scaler wrapped around
the optimizer takes the same decision everywhere); the N-th returns the aggregated sum,
divided by N when `average_aggregated_gradients`. Sums are cleared after the N-th pass
whether or not the step was applied (a non-finite window is dropped, as in Horovod).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from hvdx.arguments import integer

__all__ = ["LocalAccumulator", "aggregate_passes", "local_accumulator"]


def local_accumulator(backward_passes_per_step: int,
                      average_aggregated_gradients: bool = False) -> Optional["LocalAccumulator"]:
    """The accumulator of `backward_passes_per_step` passes (an int >= 1, NumPy's too); None
    for 1 (every pass aggregates). Raises ValueError for anything else."""
    passes = integer(backward_passes_per_step, "backward_passes_per_step", 1)
    return LocalAccumulator(passes, average_aggregated_gradients) if passes != 1 else None


def aggregate_passes(accumulator: Optional["LocalAccumulator"], aggregate: Callable[[List, List], List],
                     grads: Sequence, variables: Sequence) -> List:
    """`aggregate(grads, variables)` at once (no accumulator), or through `accumulator`: on
    its N-th pass, `aggregate(totals, variables of the gradients that are not None)`."""
    if accumulator is None:
        return aggregate(list(grads), list(variables))
    present = [v for g, v in zip(grads, variables) if g is not None]
    return accumulator(list(grads), lambda totals: aggregate(totals, present))


class LocalAccumulator(tf.Module):
    """`counter` counts the passes since the last aggregation (Horovod's `_agg_helper.counter`)."""

    def __init__(self, backward_passes_per_step: int, average_aggregated_gradients: bool = False) -> None:
        super().__init__(name="hvdx_accumulator")
        self.passes = integer(backward_passes_per_step, "backward_passes_per_step", 1)
        self.average = bool(average_aggregated_gradients)
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="hvdx_accumulation_counter")
        self._sums: List[Optional[tf.Variable]] = []

    def _sum_variables(self, grads: Sequence[Optional[tf.Tensor]]) -> List[Optional[tf.Variable]]:
        if not self._sums:
            with tf.init_scope():
                self._sums = [None if g is None else tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False,
                                                                 name="hvdx_accumulated_gradient")
                              for g in grads]
        if len(self._sums) != len(grads):
            raise ValueError(f"backward_passes_per_step: {len(grads)} gradients now, {len(self._sums)} before")
        return self._sums

    def __call__(self, grads: Sequence[Optional[tf.Tensor]],
                 aggregate: Callable[[List[Optional[tf.Tensor]]], List[Optional[tf.Tensor]]]) -> List[Optional[tf.Tensor]]:
        """Adds `grads` to the sums; on the N-th pass returns aggregate(sums) and clears them."""
        dense = []
        for g in grads:
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            dense.append(g)
        sums = self._sum_variables(dense)
        added = [s.assign_add(g) for s, g in zip(sums, dense) if g is not None]
        with tf.control_dependencies(added):
            count = self.counter.assign_add(1)
        present = [i for i, g in enumerate(dense) if g is not None]

        def boundary():
            totals = [sums[i].read_value() for i in present]
            if self.average:
                totals = [t / tf.cast(self.passes, t.dtype) for t in totals]
            averaged = aggregate(totals)
            with tf.control_dependencies(averaged):
                clear = [sums[i].assign(tf.zeros_like(sums[i])) for i in present] + [self.counter.assign(0)]
            with tf.control_dependencies(clear):
                return [tf.identity(a) for a in averaged]

        def between():
            return [tf.zeros_like(dense[i]) for i in present]

        results = tf.cond(tf.equal(count, self.passes), boundary, between)
        out: List[Optional[tf.Tensor]] = [None] * len(dense)
        for i, r in zip(present, results if isinstance(results, (list, tuple)) else [results]):
            out[i] = r
        return out

    def applies_now(self) -> tf.Tensor:
        """True right after an aggregation (the wrapped optimizer applies on that pass)."""
        return tf.equal(self.counter, 0)
