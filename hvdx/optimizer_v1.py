"""hvdx's wrapper of a `tf.compat.v1.train` optimizer (Horovod's `horovod.tensorflow.DistributedOptimizer`
wraps these too), made by `hvdx.tensorflow.DistributedOptimizer`:

    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    train_op = opt.minimize(loss, global_step=step)        # a tf.compat.v1 graph, or eagerly

`compute_gradients` returns this rank's gradients aggregated over the ranks by an
hvdx.GradientAggregator (Horovod's averaging by default, or hvdx's strategies);
`apply_gradients`, `get_slot`, `get_slot_names` and `variables` are the wrapped optimizer's.
With backward_passes_per_step = N, gradients are summed locally for N passes and the
wrapped optimizer applies them on the N-th (hvdx.accumulation.LocalAccumulator); passes in
between only advance `global_step`.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import comm
from hvdx.accumulation import aggregate_passes, local_accumulator
from hvdx.aggregator import AUTO_BUCKET_BYTES, GradientAggregator
from hvdx.wrapped import check_not_horovods

__all__ = ["DistributedOptimizerV1"]


class DistributedOptimizerV1(tf.compat.v1.train.Optimizer):
    """A tf.compat.v1.train.Optimizer whose gradients are aggregated over all ranks before
    the wrapped one applies them.

    Horovod's arguments (horovod.tensorflow.DistributedOptimizer's, same order and meaning):
    optimizer (a tf.compat.v1.train.Optimizer), name, use_locking, device_dense,
    device_sparse, compression, sparse_as_dense, backward_passes_per_step, op (Average, Sum),
    gradient_predivide_factor, average_aggregated_gradients, num_groups / groups (fusion
    buckets), process_set, scale_local_gradients. hvdx's (keyword only), as in
    hvdx.DistributedOptimizer: communication, bucket_bytes, and the strategy's options, one
    mapping validated by the registry (`hvdx.comm.choice`): density, num_samplings,
    wire_dtype, Deep Gradient Compression's aids for the sparse strategies (clip_norm,
    warmup_steps, warmup_density, residual_decay; momentum= as in DistributedGradientTape:
    the strategy accumulates the velocity, so the wrapped optimizer must have no momentum of
    its own, e.g. GradientDescentOptimizer), a registered strategy's own options. A
    tf.compat.v1 optimizer has no traits (`hvdx.comm.traits`): a strategy named gets the
    defaults it decides for none (none for hvdx's strategies), as with the tape.

    Raises ValueError for another kind of optimizer, options the aggregator rejects, or a
    strategy with momentum correction around a MomentumOptimizer (momentum applied twice).
    The aggregator (its per-rank residuals) is tracked as `_aggregator`, the wrapped
    optimizer as `_optimizer`, for object-based checkpoints; a tf.compat.v1 Saver saves
    the residuals as global variables.
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: Optional[str] = None,
                 use_locking: bool = False, device_dense: str = "", device_sparse: str = "",
                 compression=hvd.Compression.none, sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                 op=hvd.Average, gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                 num_groups: int = 0, groups=None, process_set: hvd.ProcessSet = hvd.global_process_set,
                 scale_local_gradients: bool = True, *, communication: Union[str, comm.Strategy, None] = None,
                 bucket_bytes: Union[int, None, str] = AUTO_BUCKET_BYTES, **strategy_options: Any) -> None:
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise ValueError("DistributedOptimizerV1 wraps a tf.compat.v1.train optimizer, got "
                             f"{type(optimizer).__name__} (hvdx.DistributedOptimizer wraps Keras optimizers)")
        check_not_horovods(optimizer, "hvdx.tensorflow.DistributedOptimizer", kind="tf.compat.v1",
                           example="tf.compat.v1.train.GradientDescentOptimizer(...)")
        super().__init__(use_locking=use_locking, name=name or f"Distributed{type(optimizer).__name__}")
        self._optimizer = optimizer
        self._aggregator = GradientAggregator(
            communication, bucket_bytes=bucket_bytes, op=op, gradient_predivide_factor=gradient_predivide_factor,
            compression=compression, sparse_as_dense=sparse_as_dense, process_set=process_set,
            groups=groups, num_groups=num_groups,
            scale_local_gradients=scale_local_gradients, device_dense=device_dense, device_sparse=device_sparse,
            **strategy_options)
        if self._aggregator.strategy.corrects_momentum and isinstance(
                optimizer, tf.compat.v1.train.MomentumOptimizer):
            raise ValueError(f"{self._aggregator.strategy!r} applies momentum correction (the strategy accumulates "
                             "the velocity), and the wrapped MomentumOptimizer would apply momentum again: wrap "
                             "tf.compat.v1.train.GradientDescentOptimizer, or drop momentum=")
        self._accumulator = local_accumulator(backward_passes_per_step, average_aggregated_gradients)
        self._track_trackable(optimizer, name="_optimizer")
        self._track_trackable(self._aggregator, name="_aggregator")

    @property
    def inner_optimizer(self) -> tf.compat.v1.train.Optimizer:
        return self._optimizer

    @property
    def aggregator(self) -> GradientAggregator:
        return self._aggregator

    def register_local_var(self, var) -> None:
        """Horovod's: the gradient of `var` is not aggregated (divided by the number of ranks
        when scale_local_gradients)."""
        self._aggregator.register_local_var(var)

    @tf.autograph.experimental.do_not_convert
    def compute_gradients(self, *args, **kwargs) -> List[tuple]:
        """The wrapped optimizer's compute_gradients (same arguments), aggregated over the
        ranks: [(gradient, variable)], a gradient None where the wrapped one's is."""
        grads_and_vars = list(self._optimizer.compute_gradients(*args, **kwargs))
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        return list(zip(self._aggregate(grads, variables), variables))

    def _aggregate(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        return aggregate_passes(self._accumulator, self._aggregator, grads, variables)

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's apply_gradients; with backward_passes_per_step = N, only on
        every N-th pass (the others only advance `global_step`)."""
        grads_and_vars = list(grads_and_vars)

        def apply():
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

        if self._accumulator is None:
            return apply()

        def skip():
            return tf.group(global_step.assign_add(1)) if global_step is not None else tf.no_op()

        if tf.executing_eagerly():
            return apply() if bool(self._accumulator.applies_now()) else skip()
        passed = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in grads_and_vars if g is not None]
        with tf.control_dependencies(passed):  # read the pass counter after this pass's sums
            return tf.cond(self._accumulator.applies_now(), lambda: tf.group(apply()), skip)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        """The wrapped optimizer's variables (what a broadcast of the initial state sends; the
        residuals are per rank: `.aggregator.residuals`)."""
        return self._optimizer.variables(*args, **kwargs)
