"""hvdx.DistributedGradientTape: Horovod's tape wrapper (custom training loops), with
hvdx's strategies.

    with tf.GradientTape() as tape:
        loss = ...
    tape = hvdx.DistributedGradientTape(tape)                  # Horovod's form: dense average
    tape = hvdx.DistributedGradientTape(tape, communication="hitopk", density=0.01)
    grads = tape.gradient(loss, model.trainable_variables)

`with hvdx.DistributedGradientTape(communication=...) as tape:` records with a tape of its
own. A tape usually lives for one step, so its aggregator, which holds the error-feedback
residuals, is shared by every tape created with the same options; inside it residuals are
keyed by the variables they come from, so two models never share one. Pass
`aggregator=hvdx.GradientAggregator(...)` to own (and checkpoint) it yourself.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import comm
from hvdx.arguments import is_integer, is_real
from hvdx.aggregator import AUTO_BUCKET_BYTES, GradientAggregator

__all__ = ["DistributedGradientTape", "shared_aggregator"]

_SHARED: Dict[str, GradientAggregator] = {}


def shared_aggregator(**options) -> GradientAggregator:
    """The process-wide aggregator for these options (tapes made anew every step find last
    step's residuals there)."""
    def plain(v):  # NumPy numbers as Python's: np.int64(5) finds the aggregator of 5
        if isinstance(v, dict):
            return tuple(sorted((k, plain(x)) for k, x in v.items()))
        if isinstance(v, (str, bool, type(None))):
            return v
        if is_integer(v):
            return int(v)
        if is_real(v):
            return float(v)
        return f"{type(v).__name__}@{id(v)}"

    key = repr(sorted((k, plain(v)) for k, v in options.items()))
    if key not in _SHARED:
        _SHARED[key] = GradientAggregator(**options)
    return _SHARED[key]


class DistributedGradientTape:
    """A gradient tape whose `gradient()` returns gradients aggregated over all ranks.

    Horovod's arguments, in Horovod's order: gradtape (the tf.GradientTape to wrap; None
    records with a new one), device_dense, device_sparse, compression, sparse_as_dense, op,
    gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients.
    hvdx's (keyword only): persistent, watch_accessed_variables (for a tape of its own),
    communication, bucket_bytes (as in DistributedOptimizer), loss_scale (a
    LossScaleOptimizer, variable or callable: the gradients are of a scaled loss, and
    residuals are rescaled when it changes), aggregator (the strategy options are then its
    own); and the strategy's options, one mapping validated by the registry
    (`hvdx.comm.choice`) as in DistributedOptimizer: density, num_samplings, wire_dtype,
    Deep Gradient Compression's aids for the sparse strategies (`hvdx.comm.dgc`): momentum
    (momentum correction: the strategy accumulates the velocity, so apply the gradients
    with an optimizer without momentum), clip_norm, warmup_steps, warmup_density,
    residual_decay, momentum_masking, dense_below (gradients of fewer elements sent whole;
    1024 by default, a strategy option, not an aid), and a registered strategy's own
    options. The tape wraps no optimizer: a strategy named gets the defaults it decides for
    no traits (`Strategy.defaults_for`; no aid for hvdx's strategies).
    """

    def __init__(self, gradtape: Optional[tf.GradientTape] = None, device_dense: str = "",
                 device_sparse: str = "", compression=hvd.Compression.none, sparse_as_dense: bool = False,
                 op=hvd.Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 process_set: hvd.ProcessSet = hvd.global_process_set, scale_local_gradients: bool = True, *,
                 persistent: bool = False, watch_accessed_variables: bool = True,
                 communication: Union[str, comm.Strategy, None] = None,
                 bucket_bytes: Union[int, None, str] = AUTO_BUCKET_BYTES,
                 loss_scale: Any = None, aggregator: Optional[GradientAggregator] = None,
                 **strategy_options: Any) -> None:
        if gradtape is not None and not isinstance(gradtape, tf.GradientTape):
            raise ValueError("the first argument of hvdx.DistributedGradientTape is the tf.GradientTape to wrap "
                             f"(Horovod's form), got {gradtape!r}; for a tape of its own pass persistent= and "
                             "watch_accessed_variables= by keyword")
        self._tape = gradtape if gradtape is not None else tf.GradientTape(
            persistent=persistent, watch_accessed_variables=watch_accessed_variables)
        self._local_sources = []
        if aggregator is not None:
            self.aggregator = aggregator
        else:
            self.aggregator = shared_aggregator(
                communication=communication, bucket_bytes=bucket_bytes, op=op,
                gradient_predivide_factor=gradient_predivide_factor, compression=compression,
                sparse_as_dense=sparse_as_dense, process_set=process_set, groups=groups, num_groups=num_groups,
                scale_local_gradients=scale_local_gradients, device_dense=device_dense,
                device_sparse=device_sparse, loss_scale=loss_scale,
                **{k: v for k, v in strategy_options.items() if v is not None})  # None: not given

    def register_local_source(self, source) -> None:
        """Horovod's: the gradient of `source` is not aggregated (divided by the number of
        ranks when scale_local_gradients)."""
        self._local_sources.append(source)

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat_grads = tf.nest.flatten(grads)
        flat_sources = tf.nest.flatten(sources)
        if len(flat_sources) != len(flat_grads):
            flat_sources = [None] * len(flat_grads)
        aggregated = self.aggregator(flat_grads, flat_sources, local=self._local_sources)
        return tf.nest.pack_sequence_as(grads, aggregated)

    # -- the wrapped tape's own API ----------------------------------------------------
    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tape.__exit__(*exc)

    def watch(self, tensor) -> None:
        self._tape.watch(tensor)

    def watched_variables(self):
        return self._tape.watched_variables()

    def stop_recording(self):
        return self._tape.stop_recording()

    def reset(self) -> None:
        self._tape.reset()

    def jacobian(self, *args, **kwargs):
        return self._tape.jacobian(*args, **kwargs)

    def batch_jacobian(self, *args, **kwargs):
        return self._tape.batch_jacobian(*args, **kwargs)
