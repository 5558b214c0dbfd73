"""The gradient aggregator: what DistributedOptimizer and DistributedGradientTape share.

Given one step's gradients (and the variables they belong to: tf.Variables or variables of
either Keras, a Keras 3 variable standing for the tf.Variable it holds, `hvdx.variables`),
the aggregator

1. leaves out the gradients of registered local variables (averaged nowhere; divided by
   the number of ranks when `scale_local_gradients`, as Horovod does) and sends sparse
   gradients (tf.IndexedSlices) through Horovod's sparse allreduce unless `sparse_as_dense`;
2. leaves gradients of no elements as they are (their average is themselves, as in
   Horovod) and fuses the rest into buckets (`hvdx.buckets.plan`: in backpropagation's
   order, per dtype, by `bucket_bytes` or Horovod's `groups`/`num_groups`, never more
   than 2**31 - 2**20 elements). In a tf.function each bucket's collectives start as soon as its gradients
   exist, while backpropagation continues (shi2021 Fig. 1);
3. checks, the first time it sees a layout, that every rank aggregates the same one
   (`hvdx.agreement`), bucket layouts included: one collective, and the strategy, which
   checks every layout it is called on for the first time, is told not to check again;
4. aggregates each bucket with the strategy (`hvdx.comm`), its residuals keyed by the
   variables that fill the bucket, so two models never share one;
5. commits the sparse strategies' residual updates only if every averaged gradient of the
   step is finite: identical on every rank, so a step the loss scaler skips leaves every
   residual as it was (non-finite values still reach the output, for the scaler to see).
   The sparse strategies decide this on the exchanged pairs (`Aggregated.finite`), not
   with another pass over the d-vector;
6. splits the buckets back into gradients of their original shapes and dtypes.

`last_aggregation` is the `hvdx.buckets.AggregationRecord` of the trace in progress: each
bucket's `hvdx.comm.Aggregated` and pieces, and the variables they belong to (LARS/LAMB read
their norms from the reduce-scattered slices it maps back to variables).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import comm
from hvdx.arguments import integer, is_integer, real
from hvdx.buckets import MAX_BUCKET_ELEMENTS, AggregationRecord, BucketRecord, Piece, plan
from hvdx.comm.base import DEFAULT_BUCKET_BYTES
from hvdx.comm.choice import StrategyChoice, environment_default
from hvdx.comm.allreduce import OP_NAMES
from hvdx.comm.memory import commit
from hvdx.comm.traits import OptimizerTraits
from hvdx.agreement import Agreed, check_agreement
from hvdx.topology import initialized, topology
from hvdx.variables import tf_variable

__all__ = ["AUTO_BUCKET_BYTES", "DEFAULT_BUCKET_BYTES", "GradientAggregator", "choose",
           "default_communication"]

_log = logging.getLogger("hvdx")

#: `bucket_bytes="auto"`: the strategy's own bucket size (`Strategy.bucket_bytes`: 32 MiB,
#: DEFAULT_BUCKET_BYTES, except 2DTAR's 4 MiB).
AUTO_BUCKET_BYTES = "auto"

#: The strategy (and density) used when none is given (`hvdx.comm.choice.environment_default`).
default_communication = environment_default


class _Book:
    """Python-side bookkeeping (kept out of tf.Module's attribute tracking)."""

    def __init__(self) -> None:
        self.var_sets: Dict[Any, str] = {}
        self.verified = Agreed()  # the step layouts checked, per membership
        self.checks = 0
        self.choice: Optional[StrategyChoice] = None
        self.local_refs: set = set()
        self.strategies: List[comm.Strategy] = []
        self.groups: Any = None
        self.loss_scale: Any = None
        self.last_aggregation: Optional[AggregationRecord] = None


def choose(communication: Union[str, comm.Strategy, None], options: Optional[Mapping[str, Any]] = None, *,
           compression=None, op=hvd.Average, gradient_predivide_factor: float = 1.0,
           process_set: hvd.ProcessSet = hvd.global_process_set, traits: Optional[OptimizerTraits] = None,
           wrapper_aids: Optional[Mapping[str, Any]] = None) -> StrategyChoice:
    """The strategy choice of an optimizer wrapper or tape, validated once, at construction:
    Horovod's keywords (op, gradient_predivide_factor, compression, process_set) translated
    into the strategy options they mean, and everything handed to
    `hvdx.comm.choice.StrategyChoice.resolve`.

    Args:
      communication: a strategy name, instance, or None (the environment's).
      options: the strategy options by name (None values: not given).
      compression: Horovod's compressor (hvd.Compression.fp16: wire_dtype=float16).
      op, gradient_predivide_factor, process_set: Horovod's.
      traits: the wrapped optimizer's (its defaults, `Strategy.defaults_for`); None: none.
      wrapper_aids: hvdx.DistributedOptimizer's own aids (`hvdx.comm.choice.WRAPPER_AIDS`).
    Raises:
      ValueError: a bad value, an option that does not apply to the strategy (at `build`),
        contradicting options, or options given beside a strategy instance.
      TypeError: an option no registered strategy takes.
    """
    if op not in OP_NAMES:
        raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}")
    gradient_predivide_factor = real(gradient_predivide_factor, "gradient_predivide_factor", 0, low_open=True,
                                     expected="a positive number")
    if gradient_predivide_factor != 1.0 and op is not hvd.Average:
        raise ValueError("gradient_predivide_factor != 1.0 only goes with op=hvd.Average (as in Horovod)")
    given: Dict[str, Any] = {k: v for k, v in (options or {}).items() if v is not None}
    if compression is hvd.Compression.fp16:  # Horovod's fp16 compression: a float16 wire everywhere
        wire_dtype = given.get("wire_dtype")
        if wire_dtype is not None and tf.as_dtype(wire_dtype) != tf.float16:
            raise ValueError(f"compression=hvd.Compression.fp16 and wire_dtype={tf.as_dtype(wire_dtype).name} "
                             "contradict")
        given["wire_dtype"] = tf.float16
    elif compression is not None and compression is not hvd.Compression.none:
        given["compression"] = compression
    horovod: Dict[str, Any] = {}
    if op is not hvd.Average:
        horovod["op"] = op
    if process_set is not hvd.global_process_set:
        horovod["process_set"] = process_set
    if gradient_predivide_factor != 1.0:  # Horovod's split of the average, for equal rounding
        horovod.update(prescale_factor=1.0 / gradient_predivide_factor, postscale_factor=gradient_predivide_factor)
    return StrategyChoice.resolve(communication, given, horovod=horovod, aids=wrapper_aids, traits=traits)


class GradientAggregator(tf.Module):
    """Fuses gradients into buckets, aggregates each with a strategy, splits them back.

    DistributedOptimizer and DistributedGradientTape construct one with their options; the
    strategy choice is resolved and validated once, here (`choose`, `choice`). The strategy
    can be replaced between steps (`aggregator.strategy = "hierarchical"`, `switch`); every
    strategy used keeps its residuals, so switching back resumes them.

    Args:
      communication: a strategy name, instance, or None ($HVDX_COMMUNICATION, else "allreduce").
      bucket_bytes: the bucket size: an int, None (one bucket per dtype) or "auto" (the
        strategy's own, `Strategy.bucket_bytes`).
      op, gradient_predivide_factor, compression, sparse_as_dense, process_set, groups,
        num_groups, scale_local_gradients, device_dense, device_sparse: Horovod's.
      loss_scale: a LossScaleOptimizer, variable or callable: the gradients are of a
        scaled loss (residuals are rescaled when it changes).
      traits: the wrapped optimizer's (`hvdx.comm.traits`), for the strategy's defaults
        (`Strategy.defaults_for`); None: no optimizer (the tape).
      wrapper_aids: hvdx.DistributedOptimizer's own aids, as given (`hvdx.comm.choice.WRAPPER_AIDS`).
      strategy_options: the strategy's options by name (density=, num_samplings=,
        wire_dtype=, DGC's aids, a registered strategy's own; None: not given).
    Raises:
      ValueError, TypeError: as `choose` and `StrategyChoice.build`; a bad bucket_bytes or groups.
    """

    def __init__(self, communication: Union[str, comm.Strategy, None] = None, *,
                 bucket_bytes: Union[int, None, str] = AUTO_BUCKET_BYTES, op=hvd.Average,
                 gradient_predivide_factor: float = 1.0, compression=None,
                 sparse_as_dense: bool = False, process_set: hvd.ProcessSet = hvd.global_process_set,
                 groups: Union[None, int, Sequence[Sequence[tf.Variable]]] = None, num_groups: int = 0,
                 scale_local_gradients: bool = True, device_dense: str = "", device_sparse: str = "",
                 loss_scale: Union[None, Callable[[], tf.Tensor], Any] = None,
                 traits: Optional[OptimizerTraits] = None, wrapper_aids: Optional[Mapping[str, Any]] = None,
                 name: str = "hvdx_aggregator", **strategy_options: Any) -> None:
        super().__init__(name=name)
        if not (bucket_bytes is None or isinstance(bucket_bytes, str) and bucket_bytes == AUTO_BUCKET_BYTES):
            bucket_bytes = integer(bucket_bytes, "bucket_bytes", 1, expected=(
                "a positive int, None (one buffer per dtype) or 'auto' (the strategy's own size)"))
        if num_groups and groups is not None:
            raise ValueError("give num_groups or groups, not both (num_groups is Horovod's older name)")
        groups = groups if groups is not None else (num_groups or None)
        if is_integer(groups):
            groups = integer(groups, "groups", 0, expected="an int >= 0 (that many buckets)")
        elif groups is not None and not (isinstance(groups, (list, tuple)) and all(
                isinstance(g, (list, tuple)) for g in groups)):
            raise ValueError(f"groups must be an int (that many buckets) or a list of lists of variables, got "
                             f"{groups!r}")
        if groups is not None and not is_integer(groups):
            groups = [[tf_variable(v) for v in group] for group in groups]
        choice = choose(communication, strategy_options, compression=compression, op=op,
                        gradient_predivide_factor=gradient_predivide_factor, process_set=process_set,
                        traits=traits, wrapper_aids=wrapper_aids)
        strategy = choice.build()
        self._book = _Book()
        self._book.choice = choice
        self._sum = op is hvd.Sum
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self.op = op
        self.compression = compression
        self._book.groups = groups
        self.scale_local_gradients = bool(scale_local_gradients)
        self.device_dense, self.device_sparse = device_dense, device_sparse
        self._book.loss_scale = loss_scale
        self.bucket_bytes = bucket_bytes
        self.max_bucket_elements = MAX_BUCKET_ELEMENTS
        self._memories: List[comm.ResidualMemory] = []  # tracked: checkpoints carry the residuals
        self._use(strategy)

    # -- configuration -----------------------------------------------------------------
    @property
    def strategy(self) -> comm.Strategy:
        return self._strategy

    @strategy.setter
    def strategy(self, communication: Union[str, comm.Strategy]) -> None:
        self.switch(communication)

    @property
    def choice(self) -> StrategyChoice:
        """The strategy choice (`hvdx.comm.choice.StrategyChoice`): the current strategy's name or
        instance, the options given, the wrapped optimizer's traits."""
        return self._book.choice

    def switch(self, communication: Union[str, comm.Strategy], traits: Optional[OptimizerTraits] = None) -> None:
        """Uses `communication` from the next trace on: an instance as it is, a name built from
        the options given at construction that apply to it over the defaults it decides for
        the wrapped optimizer (`StrategyChoice.switch`; `traits`: the optimizer's now, None:
        those given at construction); an earlier instance equal to it is reused (its
        residuals with it).

        Raises:
          ValueError: an unknown name, or a bad value for the new strategy.
        """
        choice = self._book.choice.switch(communication, traits)
        strategy = choice.build(strict=False)
        self._book.choice = choice
        self._use(strategy)

    def use_process_set(self, process_set: hvd.ProcessSet) -> None:
        """The ranks that take part changed (Elastic Horovod re-initialised: the old process
        set's id means nothing now): the aggregation and every strategy that takes a
        `process_set` run over `process_set` from the next trace on, and a later `switch`
        builds with it."""
        self.process_set = process_set
        horovod = {k: v for k, v in self._book.choice.horovod.items() if k != "process_set"}
        if process_set is not hvd.global_process_set:
            horovod["process_set"] = process_set
        self._book.choice = dataclasses.replace(self._book.choice, horovod=horovod)
        for strategy in self._book.strategies:
            if "process_set" in type(strategy).options:
                strategy.process_set = process_set

    def _use(self, strategy: comm.Strategy) -> None:
        """Makes `strategy` the current one, or an earlier instance equal to it."""
        for known in self._book.strategies:  # reuse an earlier instance of the same kind
            if type(known) is type(strategy) and repr(known) == repr(strategy):
                strategy = known
                break
        else:
            self._book.strategies.append(strategy)
            self._memories = [m for s in self._book.strategies for m in s.memories]
        self._strategy = strategy

    @property
    def effective_bucket_bytes(self) -> Optional[int]:
        """The bucket size the next trace plans with: `bucket_bytes`, or with "auto" the
        current strategy's (`Strategy.bucket_bytes`)."""
        if self.bucket_bytes == AUTO_BUCKET_BYTES:
            return type(self._strategy).bucket_bytes
        return self.bucket_bytes

    @property
    def config(self) -> Dict[str, Any]:
        """The options that rebuild this aggregator (JSON-serialisable)."""
        strategy = self._strategy
        if not comm.is_name(strategy.key) or comm.strategy_class(strategy.key) is not type(strategy):
            raise ValueError(f"a strategy {strategy!r} that is not registered (hvdx.comm.register) cannot be "
                             "saved in a config")
        out: Dict[str, Any] = {"communication": strategy.key, **strategy.get_config()}
        if out.get("wire_dtype") == "float16" and self.compression is hvd.Compression.fp16:
            del out["wire_dtype"]  # Horovod's compression option says it
        out["bucket_bytes"] = self.bucket_bytes
        return out

    @property
    def num_groups(self) -> int:
        """Horovod's `num_groups`: the number of equal-count buckets asked for; 0 where the
        groups are lists of variables or none were given."""
        return self._book.groups if isinstance(self._book.groups, int) else 0

    @property
    def groups_are_variables(self) -> bool:
        """Whether fusion groups were given as lists of variables (not serialisable)."""
        return isinstance(self._book.groups, (list, tuple))

    def register_local_var(self, variable) -> None:
        """Gradients of `variable` stay local: never averaged (divided by the number of ranks
        if scale_local_gradients, as in Horovod)."""
        self._book.local_refs.add(_ref(variable))

    register_local_source = register_local_var

    def _is_local(self, variable, extra: set = frozenset()) -> bool:
        if variable is None or not (self._book.local_refs or extra):
            return False
        ref = _ref(variable)
        return ref in self._book.local_refs or ref in extra

    @property
    def last_aggregation(self) -> Optional[AggregationRecord]:
        """What the last aggregation of the trace in progress produced: each bucket's result
        and pieces, and the variables they belong to (LARS/LAMB, diagnostics); None before."""
        return self._book.last_aggregation

    @property
    def residuals(self) -> List[tf.Variable]:
        """Every strategy's error-feedback residuals (per rank state)."""
        return [v for s in self._book.strategies for v in s.variables.values()]

    def _current_loss_scale(self) -> Optional[tf.Tensor]:
        scale = self._book.loss_scale
        if scale is None:
            return None
        if hasattr(scale, "loss_scale"):  # a LossScaleOptimizer
            scale = scale.loss_scale
        if callable(scale):
            scale = scale()
        return tf.cast(scale, tf.float32)

    def build(self, variables: Sequence[Any]) -> None:
        """Creates the strategy's residuals for the gradients of `variables` (all of them
        present), as the first step would: checkpoints and saved models restore into them."""
        if not self._strategy.lossy:
            return
        variables = [tf_variable(v) for v in variables if not self._is_local(v)]
        shapes = [tf.TensorShape(v.shape) for v in variables]
        fused = [i for i, shape in enumerate(shapes) if shape.is_fully_defined() and shape.num_elements()]
        grads = [tf.TensorSpec(shape, v.dtype) for v, shape in zip(variables, shapes)]  # what the plan reads
        set_key = self._set_key(grads, variables, fused)
        for b, bucket in enumerate(self._bucket_plan(grads, variables, fused)):
            self._strategy.create_state(f"{set_key}_b{b}", sum(p.stop - p.start for p in bucket),
                                        shapes=_piece_shapes(grads, bucket))

    # -- the step ----------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads: Sequence[Any], variables: Optional[Sequence[Any]] = None,
                 local: Sequence[Any] = ()) -> List[Any]:
        """The averaged gradients, in the order, shapes and dtypes given; None stays None.
        Gradients of registered local variables, and of `local`, are not aggregated."""
        grads = list(grads)
        extra_local = {_ref(v) for v in local}
        variables = [tf_variable(v) for v in variables] if variables is not None else [None] * len(grads)
        if len(variables) != len(grads):
            raise ValueError(f"{len(grads)} gradients but {len(variables)} variables")
        out: List[Any] = list(grads)
        size = self._world_size()
        fused, sparse, dynamic = [], [], []
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None:
                continue
            if self._is_local(v, extra_local):
                out[i] = _scaled(g, 1.0 / size) if self.scale_local_gradients else g
            elif isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense:
                sparse.append(i)
            else:
                g = tf.convert_to_tensor(g)
                grads[i] = g
                if not g.shape.is_fully_defined():
                    dynamic.append(i)
                elif g.shape.num_elements():
                    fused.append(i)
                # else: no elements, so its average is itself (as Horovod returns it)
        self._check_layout(grads, variables, fused, sparse, dynamic)
        # Already sparse (Horovod's all-gather of values and indices), or of no static shape
        # (no fusion): Horovod's allreduce of the tensor itself.
        for kind, indices, device in (("sparse", sparse, self.device_sparse), ("dynamic", dynamic, self.device_dense)):
            with tf.device(device):
                for i in indices:
                    out[i] = hvd.allreduce(grads[i], op=self.op, process_set=self.process_set,
                                           compression=self.compression or hvd.Compression.none,
                                           name=f"hvdx.{kind}.{i}")
        with tf.device(self.device_dense):
            updates, checked = self._aggregate_fused(grads, variables, fused, out)
        if updates:  # residuals change only on steps whose averaged gradients are all finite
            with tf.name_scope("commit"):
                finite = tf.reduce_all([*checked, *(
                    tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
                    for i, g in enumerate(out) if g is not None and i not in fused)])
                written = commit(updates, finite)
            if not _in_function():  # a tf.function runs every stateful op; a TF1 graph needs the edge
                with tf.control_dependencies([written]):
                    out = [None if g is None else tf.identity(g) if not isinstance(g, tf.IndexedSlices)
                           else tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape) for g in out]
        return out

    def _world_size(self) -> int:
        return self.process_set.size() if self.process_set is not hvd.global_process_set else hvd.size()

    def _bucket_plan(self, grads: List[Any], variables: List[Any], fused: List[int]):
        """`hvdx.buckets.plan` of the fused gradients with this aggregator's options."""
        return plan({i: grads[i].shape.num_elements() for i in fused}, {i: grads[i].dtype for i in fused},
                    variables, groups=self._book.groups, bucket_bytes=self.effective_bucket_bytes,
                    max_elements=self.max_bucket_elements)

    def _set_key(self, grads: List[tf.Tensor], variables: List[Any], fused: List[int]) -> str:
        """The residual namespace of these variables (in this graph): v0, v1, ... in order of
        first appearance, so that a program that builds its models in the same order gets
        the same names back from a checkpoint."""
        with tf.init_scope():
            graph = None if tf.executing_eagerly() else id(tf.compat.v1.get_default_graph())
        identity = tuple(variables[i].ref() if variables[i] is not None
                         else ("tensor", tuple(grads[i].shape.as_list()), grads[i].dtype.name) for i in fused)
        key = (graph, identity)
        if key not in self._book.var_sets:
            self._book.var_sets[key] = f"v{len(self._book.var_sets)}"
        return self._book.var_sets[key]

    def _bucket_layouts(self, grads: List[Any], variables: List[Any], fused: List[int]
                        ) -> List[Tuple[str, Tuple[int, ...], tf.DType, List[Optional[Tuple[int, ...]]]]]:
        """Each bucket's (buffer name, piece lengths, dtype the strategy receives, the pieces'
        gradient shapes), in order."""
        set_key = self._set_key(grads, variables, fused)
        return [(f"{set_key}_b{b}", tuple(p.stop - p.start for p in bucket),
                 tf.float32 if self._strategy.lossy else grads[bucket[0].index].dtype, _piece_shapes(grads, bucket))
                for b, bucket in enumerate(self._bucket_plan(grads, variables, fused))]

    def _check_layout(self, grads, variables, fused, sparse, dynamic) -> None:
        """The step's one agreement check, the first time its layout is seen (`hvdx.agreement`).
        It covers the buckets the strategy will be called on, so the strategy does not check
        them again (`Strategy.agreed`)."""
        shapes = [tuple(g.shape.as_list()) if g is not None and hasattr(g, "shape") and g.shape.rank is not None
                  else None for g in grads]
        buckets = self._bucket_layouts(grads, variables, fused)
        description = {
            "strategy": repr(self._strategy),
            "op": OP_NAMES[self.op],
            "sparse_as_dense": str(self.sparse_as_dense),
            "gradients": str([(i, grads[i].dtype.name, shapes[i]) if grads[i] is not None else (i, None)
                              for i in range(len(grads))]),
            "fused": str(fused), "sparse": str(sparse), "dynamic": str(dynamic),
            "groups": str(self._book.groups if isinstance(self._book.groups, int) else
                          [len(g) for g in (self._book.groups or [])]),
            # named to sort after the fields they follow from (the bucket size from the strategy
            # with bucket_bytes="auto"; the layouts from everything): a difference names its cause first
            "with bucket_bytes": str(self.effective_bucket_bytes),
            "with the bucket layouts": str([(name, list(sizes), dtype.name) for name, sizes, dtype, _ in buckets]),
        }
        signature = tuple(sorted(description.items()))
        verified = self._book.verified.under(topology() if initialized() else None)
        if signature in verified:
            return
        self._book.checks += 1
        check_agreement(description, "the gradients to aggregate", process_set=self.process_set)
        self._strategy.agree_state([name for name, _, _, _ in buckets], self.process_set)
        verified.add(signature)
        for name, sizes, dtype, piece_shapes in buckets:
            self._strategy.agreed(name, sizes, dtype, piece_shapes)

    def _aggregate_fused(self, grads: List[tf.Tensor], variables: List[Any], fused: List[int],
                         out: List[Any]) -> Tuple[List[Any], List[tf.Tensor]]:
        """Aggregates the fused gradients into `out`, bucket by bucket; returns the residual
        updates to commit and the finiteness of every bucket (scalars, from the strategy
        where it has a cheap one, else a check of the bucket's output)."""
        self._book.last_aggregation = AggregationRecord(tuple(variables), (), self.process_set)
        if not fused:
            return [], []
        strategy = self._strategy
        buckets = self._bucket_plan(grads, variables, fused)
        set_key = self._set_key(grads, variables, fused)
        loss_scale = self._current_loss_scale() if strategy.lossy else None
        with tf.name_scope("fuse"):
            flat = {i: tf.reshape(grads[i], [-1]) for i in fused}
        outputs: Dict[int, List[tf.Tensor]] = {i: [] for i in fused}
        updates, checked, records = [], [], []
        for b, bucket in enumerate(buckets):
            dtype = grads[bucket[0].index].dtype
            if strategy.lossy and dtype == tf.float64:
                raise ValueError(f"{strategy!r} selects float32 values; float64 gradients need a dense strategy "
                                 "(communication='allreduce' or 'hierarchical')")
            work = tf.float32 if strategy.lossy else dtype  # sparse strategies select in float32
            with tf.name_scope("fuse"):
                parts = [tf.cast(flat[p.index] if (p.start, p.stop) == (0, flat[p.index].shape[0])
                                 else flat[p.index][p.start:p.stop], work) for p in bucket]
            with tf.name_scope(strategy.key or "strategy"):
                pieces, result = strategy.aggregate_pieces(parts, f"{set_key}_b{b}", residual_scale=loss_scale,
                                                           grouped=self._book.groups is not None,
                                                           shapes=_piece_shapes(grads, bucket))
            records.append(BucketRecord(result, tuple(bucket)))
            updates.extend(result.updates)
            if strategy.lossy:
                checked.append(result.finite if result.finite is not None else tf.reduce_all(
                    [tf.reduce_all(tf.math.is_finite(piece)) for piece in pieces]))
            if self._sum and "op" not in strategy.options:  # the strategy averaged: Sum is n times that
                pieces = [piece * tf.cast(self._world_size(), work) for piece in pieces]
            for p, piece in zip(bucket, pieces):
                outputs[p.index].append(tf.cast(piece, dtype))
        self._book.last_aggregation = AggregationRecord(tuple(variables), tuple(records), self.process_set)
        with tf.name_scope("split"):
            for i in fused:
                whole = outputs[i][0] if len(outputs[i]) == 1 else tf.concat(outputs[i], axis=0)
                out[i] = tf.reshape(whole, grads[i].shape)
        return updates, checked


def _piece_shapes(grads: Sequence[Any], bucket: Sequence[Piece]) -> List[Optional[Tuple[int, ...]]]:
    """Each piece's gradient shape (`Strategy.aggregate_pieces`' `shapes`): None for a piece
    that is part of a gradient (a gradient of more than a bucket's limit spans two)."""
    return [tuple(grads[p.index].shape.as_list()) if (p.start, p.stop) == (0, grads[p.index].shape.num_elements())
            else None for p in bucket]


def _in_function() -> bool:
    """Whether ops are being added to a tf.function's graph (which runs every stateful op)."""
    return isinstance(tf.compat.v1.get_default_graph(), tf.__internal__.FuncGraph)


def _ref(variable) -> Any:
    """A hashable identity of a variable of either Keras (or of another source of a tape)."""
    variable = tf_variable(variable)
    return variable.ref() if hasattr(variable, "ref") else id(variable)


def _scaled(g, factor: float):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(factor, g.dtype)
