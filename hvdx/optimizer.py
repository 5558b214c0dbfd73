"""hvdx.DistributedOptimizer and hvdx.DistributedGradientTape: Horovod's ergonomics with
hvdx's aggregation strategies (DESIGN.md "One training step").

Gradients are fused into one flat float32 buffer (or size-bounded buckets), aggregated by a
strategy of hvdx.comm (HiTopKComm by default), split back and applied by the wrapped
optimizer, which keeps its own type and configuration (`.inner_optimizer`).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import tensorflow as tf

from hvdx import comm

__all__ = ["DistributedGradientTape", "DistributedOptimizer", "GradientAggregator", "shared_aggregator"]

_KERAS_OPTIMIZERS = (tf.keras.optimizers.Optimizer, tf.keras.optimizers.legacy.Optimizer)


class _CallableList(list):
    """A list that also answers `()`, as Keras' own optimizer.variables does."""

    def __call__(self):
        return self


class GradientAggregator(tf.Module):
    """Fuses gradients into buckets, aggregates each with a strategy, splits them back.

    The strategy can be replaced between steps (`aggregator.strategy = "hierarchical"`);
    every strategy used keeps its residuals, so switching back resumes them.
    """

    def __init__(self, communication: Union[str, comm.Strategy] = "hitopk", density: float = 0.01,
                 num_samplings: int = 30, wire_dtype: tf.DType = tf.float32,
                 bucket_bytes: Optional[int] = None, name: str = "hvdx_aggregator") -> None:
        super().__init__(name=name)
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
            raise ValueError(f"bucket_bytes must be a positive int or None, got {bucket_bytes!r}")
        self._options = dict(density=density, num_samplings=num_samplings, wire_dtype=wire_dtype)
        self.bucket_bytes = bucket_bytes
        self._strategies: List[comm.Strategy] = []  # tracked: their residuals are checkpointed
        self.strategy = communication

    @property
    def strategy(self) -> comm.Strategy:
        return self._strategy

    @strategy.setter
    def strategy(self, communication: Union[str, comm.Strategy]) -> None:
        options = {} if isinstance(communication, comm.Strategy) else self._options
        strategy = comm.get(communication, **options)
        for known in self._strategies:  # reuse an earlier instance of the same kind
            if type(known) is type(strategy) and repr(known) == repr(strategy):
                strategy = known
                break
        else:
            self._strategies.append(strategy)
        self._strategy = strategy

    def _buckets(self, sizes: Sequence[int]) -> List[List[int]]:
        """Consecutive gradient indices grouped so that a bucket holds <= bucket_bytes."""
        if self.bucket_bytes is None:
            return [list(range(len(sizes)))]
        buckets, current, used = [], [], 0
        for i, size in enumerate(sizes):
            if current and used + 4 * size > self.bucket_bytes:
                buckets.append(current)
                current, used = [], 0
            current.append(i)
            used += 4 * size
        return buckets + ([current] if current else [])

    def __call__(self, grads: Sequence[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in present]  # IndexedSlices -> dense
        sizes = [int(g.shape.num_elements()) for g in dense]
        out: List[Optional[tf.Tensor]] = list(grads)
        for b, bucket in enumerate(self._buckets(sizes)):
            flat = tf.concat([tf.reshape(tf.cast(dense[i], tf.float32), [-1]) for i in bucket], axis=0)
            averaged = self._strategy(flat, name=f"bucket{b}")
            for i, piece in zip(bucket, tf.split(averaged, [sizes[i] for i in bucket])):
                out[present[i]] = tf.cast(tf.reshape(piece, dense[i].shape), dense[i].dtype)
        # Residuals are created on a strategy's first call; an attribute list makes them
        # part of every checkpoint that holds this aggregator.
        self._residual_variables = self.residuals
        return out

    @property
    def residuals(self) -> List[tf.Variable]:
        """Every strategy's error-feedback residuals (per rank state)."""
        return [v for s in self._strategies for v in s.variables.values()]


class DistributedOptimizer(tf.keras.optimizers.Optimizer):
    """Wraps a tf.keras optimizer so that gradients are averaged over all ranks by an
    hvdx.comm strategy before the wrapped optimizer applies them.

        opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="hitopk",
                                        density=0.01)
        model.compile(optimizer=opt, loss=...)

    Args:
      optimizer: a tf.keras optimizer (new or legacy API); it keeps its type and
        configuration and is reachable as `.inner_optimizer`.
      communication: "hitopk" (default), "hierarchical", "sparse_allgather", "allreduce"
        or an hvdx.comm.Strategy; switch later with `set_communication`.
      density, num_samplings, wire_dtype: options of the sparse strategies.
      bucket_bytes: fuse gradients into buckets of at most this many bytes (default: one).
    """

    def __init__(self, optimizer, communication: Union[str, comm.Strategy] = "hitopk",
                 density: float = 0.01, num_samplings: int = 30, wire_dtype: tf.DType = tf.float32,
                 bucket_bytes: Optional[int] = None, name: Optional[str] = None) -> None:
        if not isinstance(optimizer, _KERAS_OPTIMIZERS):
            raise ValueError("hvdx.DistributedOptimizer wraps a tf.keras optimizer "
                             "(tf.keras.optimizers.* or tf.keras.optimizers.legacy.*), got "
                             f"{type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("the optimizer is already an hvdx.DistributedOptimizer")
        self._aggregator_ready = False
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}")
        self._optimizer = optimizer
        self._aggregator = GradientAggregator(communication, density=density,
                                              num_samplings=num_samplings, wire_dtype=wire_dtype,
                                              bucket_bytes=bucket_bytes)
        self._aggregator_ready = True

    @property
    def inner_optimizer(self):
        return self._optimizer

    @property
    def aggregator(self) -> GradientAggregator:
        return self._aggregator

    @property
    def communication(self) -> comm.Strategy:
        return self._aggregator.strategy

    def set_communication(self, communication: Union[str, comm.Strategy]) -> None:
        """Switches the strategy; takes effect when the step function is traced again
        (hvdx.callbacks.SwitchCommunication does that for Model.fit)."""
        self._aggregator.strategy = communication

    def compute_gradients(self, loss, var_list, tape=None):
        grads_and_vars = self._optimizer.compute_gradients(loss, var_list, tape=tape) \
            if isinstance(self._optimizer, tf.keras.optimizers.Optimizer) \
            else self._optimizer._compute_gradients(loss, var_list, tape=tape)
        return list(grads_and_vars)

    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        grads = self._aggregator([g for g, _ in grads_and_vars])
        return self._optimizer.apply_gradients(list(zip(grads, [v for _, v in grads_and_vars])))

    def minimize(self, loss, var_list, tape=None):
        self.apply_gradients(self.compute_gradients(loss, var_list, tape=tape))

    def build(self, var_list):
        if isinstance(self._optimizer, tf.keras.optimizers.Optimizer):
            self._optimizer.build(var_list)
        else:
            self._optimizer._create_all_weights(var_list)

    @property
    def variables(self):
        """The wrapped optimizer's variables (the residuals are per rank: see `.aggregator`)."""
        inner = self._optimizer.variables
        return _CallableList(inner() if callable(inner) else inner)

    @property
    def iterations(self):
        return self._optimizer.iterations

    @iterations.setter
    def iterations(self, variable):
        if getattr(self, "_aggregator_ready", False):
            self._optimizer.iterations = variable
        else:  # the base constructor sets its own counter first
            self._iterations = variable

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        if getattr(self, "_aggregator_ready", False):
            self._optimizer.learning_rate = value

    def get_config(self):
        return {"optimizer": tf.keras.optimizers.serialize(self._optimizer),
                "communication": self._aggregator.strategy.key, **self._aggregator._options,
                "bucket_bytes": self._aggregator.bucket_bytes, "name": self.name}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = tf.keras.optimizers.deserialize(config["optimizer"],
                                                             custom_objects=custom_objects)
        return cls(**config)


_SHARED_AGGREGATORS: dict = {}


def shared_aggregator(communication: Union[str, comm.Strategy] = "hitopk", **options) -> GradientAggregator:
    """The process-wide aggregator for this configuration, so that a tape created anew at
    every step still finds last step's residuals (error feedback)."""
    key = (communication if isinstance(communication, str) else id(communication),
           tuple(sorted((k, str(v)) for k, v in options.items())))
    if key not in _SHARED_AGGREGATORS:
        _SHARED_AGGREGATORS[key] = GradientAggregator(communication, **options)
    return _SHARED_AGGREGATORS[key]


class DistributedGradientTape(tf.GradientTape):
    """A tf.GradientTape whose gradient() returns gradients averaged over all ranks by an
    hvdx.comm strategy (the custom-training-loop counterpart of DistributedOptimizer).

    Tapes created with the same options share one aggregator (and its residuals) for the
    life of the process; pass `aggregator=` to manage it yourself (e.g. to checkpoint it).
    """

    def __init__(self, persistent: bool = False, watch_accessed_variables: bool = True,
                 communication: Union[str, comm.Strategy] = "hitopk", density: float = 0.01,
                 num_samplings: int = 30, wire_dtype: tf.DType = tf.float32,
                 bucket_bytes: Optional[int] = None,
                 aggregator: Optional[GradientAggregator] = None) -> None:
        super().__init__(persistent=persistent, watch_accessed_variables=watch_accessed_variables)
        self.aggregator = aggregator or shared_aggregator(
            communication, density=density, num_samplings=num_samplings, wire_dtype=wire_dtype,
            bucket_bytes=bucket_bytes)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = super().gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, self.aggregator(flat))
