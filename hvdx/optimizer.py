"""hvdx.DistributedOptimizer: Horovod's Keras optimizer wrapper, with hvdx's strategies.

    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))                   # = Horovod
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="hitopk",
                                    density=0.01)                                    # sparse

The arguments are Horovod's, in Horovod's order, followed by hvdx's keyword-only ones;
the strategy's options (density=, ...) travel as one mapping, validated and resolved once
with the strategy choice (`hvdx.comm.choice`), and the strategy decides its default aids
for the wrapped optimizer's traits (`hvdx.comm.traits`, `Strategy.defaults_for`).
Aggregation runs at Keras' gradient-aggregation hook (`aggregate_gradients`), which a
LossScaleOptimizer (mixed precision) calls before its finiteness check: every rank decides
on the same averaged gradients, so no rank skips a step the others take.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, List, Optional, Sequence, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import comm
from hvdx.accumulation import aggregate_passes, local_accumulator
from hvdx.aggregator import AUTO_BUCKET_BYTES, GradientAggregator
from hvdx.buckets import AggregationObserver
from hvdx.comm import sparse
from hvdx.comm.base import HOROVOD_OPTIONS
from hvdx.comm.allreduce import OP_NAMES
from hvdx.comm.traits import OptimizerTraits, plain_number, traits_of
from hvdx.optimizers import lars
from hvdx.wrapped import Momentum, check_not_horovods, subclass_for

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]

_KERAS_OPTIMIZERS = (tf.keras.optimizers.Optimizer, tf.keras.optimizers.legacy.Optimizer)
_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


class _CallableList(list):
    """A list that also answers `()`, as Keras' own optimizer.variables does."""

    def __call__(self):
        return self


def _is_legacy(optimizer) -> bool:
    return isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer)


def _compression_name(compression) -> str:
    for name, value in _COMPRESSIONS.items():
        if compression is value:
            return name
    raise ValueError(f"compression {compression!r} cannot be saved in a config (only none and fp16 can)")


@tf.keras.utils.register_keras_serializable(package="hvdx")
class DistributedOptimizer(tf.keras.optimizers.Optimizer):
    """Wraps a tf.keras optimizer so that gradients are aggregated over all ranks before
    the wrapped optimizer applies them. Like Horovod's, the wrapper is an instance of the
    wrapped optimizer's class (of a new-style Keras optimizer's; hvdx.wrapped).

    Horovod's arguments (same meaning, same order): name, device_dense, device_sparse,
    compression (hvd.Compression.fp16 sends 16-bit values with every strategy),
    sparse_as_dense, gradient_predivide_factor, op (Average, Sum; Adasum with
    communication="allreduce"), backward_passes_per_step, average_aggregated_gradients,
    num_groups / groups (fusion buckets), process_set (communication="allreduce"),
    scale_local_gradients.

    hvdx's (keyword only):
      communication: "allreduce" (default: exactly Horovod's averaging), "hierarchical"
        (2DTAR), "hitopk" (HiTopKComm) or "sparse_allgather" (NaiveAG), another registered
        name, or an hvdx.comm.Strategy. $HVDX_COMMUNICATION / $HVDX_DENSITY change the default.
      bucket_bytes: gradients are fused into buckets, filled from the last layer to the
        first, each closed once it holds this many bytes; a bucket's collectives start
        while backpropagation goes on. "auto" (default): the strategy's own size
        (`Strategy.bucket_bytes`: 32 MiB; 4 MiB for "hierarchical"). None: one buffer per
        dtype.
      momentum_correction: Deep Gradient Compression's momentum correction (`hvdx.comm.dgc`):
        the wrapped optimizer's momentum is accumulated by the strategy before selection,
        with momentum factor masking, and the wrapped optimizer applies the aggregate
        without momentum. None (default): the strategy's default (`Strategy.defaults_for`).
      local_trust_ratio: hvdx's LARS only: eq. 11's trust ratio is applied to each rank's
        gradient before the sparse strategy accumulates it, and the step applies the
        aggregate with ratio 1 (hvdx.optimizers.lars). None (default): the strategy's default.
      trust_norms: what that trust ratio divides by: "average" (default), the norm of the
        gradients averaged over the ranks, estimated before aggregating them from one small
        allreduce of their CountSketches (hvdx.optimizers.sketch); "rank", each rank's own
        norm (smaller steps where the ranks' gradients are mostly noise).
      strategy_options: the strategy's options, one mapping validated by the registry
        (`hvdx.comm.choice`; an option the strategy does not take is rejected, naming the
        strategies that take it): density, num_samplings (MSTopK's, for the sparse
        strategies: density 0.01 by default there), wire_dtype (float32, float16,
        bfloat16), DGC's aids for the sparse strategies (clip_norm, warmup_steps,
        warmup_density, residual_decay, momentum_masking; docs/comm.md), dense_below (the
        sparse strategies send a bucket's gradients of fewer elements whole; 1024 by
        default), and a registered
        strategy's own options (node_engine=, flat_below=, ...). Where the user gives none,
        the strategy decides the aids for the wrapped optimizer's traits
        (`hvdx.comm.traits.traits_of`, `Strategy.defaults_for`); for the sparse strategies
        (`hvdx.comm.sparse.TopKStrategy.defaults_for`): momentum correction for Keras' SGD
        with a momentum (not Nesterov) at density <= 0.1, a 100-step density warm-up for the
        Adam family and LAMB at density < 0.25, LARS' local trust ratio (classic momentum) at
        density <= 0.1 with momentum correction up to 0.01 (measured, docs/comm.md). A
        strategy instance gets no defaults.

    The wrapped optimizer keeps its type and configuration (`.inner_optimizer`); its
    hyper-parameters are reachable on the wrapper (`opt.momentum`), as Horovod's callbacks
    expect. A wrapped `hvdx.buckets.AggregationObserver` (LARS, LAMB) is given each
    aggregation's record before it applies the gradients.
    """

    _HAS_AGGREGATE_GRAD = True
    averages_gradients_every_step = True  # hvdx.wrapped.SYNCHRONOUS_MARKER: asynchronous methods refuse it

    def __new__(cls, optimizer=None, *args, **kwargs):
        # An instance of the wrapped optimizer's class, as Horovod's wrapper (hvdx.wrapped).
        made = subclass_for(cls, type(optimizer))
        if not issubclass(made, cls):
            raise TypeError(f"this class wraps a {cls._hvdx_wrapped_class.__name__}, not a "
                            f"{type(optimizer).__name__}: call hvdx.DistributedOptimizer(optimizer)")
        return super().__new__(made)

    def __init__(self, optimizer, name: Optional[str] = None, device_dense: str = "", device_sparse: str = "",
                 compression=hvd.Compression.none, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, op=hvd.Average, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                 process_set: hvd.ProcessSet = hvd.global_process_set, scale_local_gradients: bool = True, *,
                 communication: Union[str, comm.Strategy, None] = None,
                 bucket_bytes: Union[int, None, str] = AUTO_BUCKET_BYTES, momentum_correction: Optional[bool] = None,
                 local_trust_ratio: Optional[bool] = None, trust_norms: str = "average",
                 **strategy_options: Any) -> None:
        if isinstance(name, comm.Strategy) or comm.is_name(name):
            raise ValueError(f"the second argument is the optimizer's name (Horovod's order); pass the strategy "
                             f"as communication={name!r}")
        if not isinstance(optimizer, _KERAS_OPTIMIZERS):
            hint = ("; a tf.compat.v1.train optimizer is wrapped by hvdx.tensorflow.DistributedOptimizer"
                    if isinstance(optimizer, tf.compat.v1.train.Optimizer) else "")
            raise ValueError("hvdx.DistributedOptimizer wraps a tf.keras optimizer "
                             "(tf.keras.optimizers.* or tf.keras.optimizers.legacy.*), got "
                             f"{type(optimizer).__name__}{hint}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("the optimizer is already an hvdx.DistributedOptimizer")
        check_not_horovods(optimizer, "hvdx.DistributedOptimizer")
        if strategy_options.get("momentum") is not None:  # the strategy's momentum is the wrapped optimizer's
            raise ValueError("hvdx.DistributedOptimizer takes momentum_correction=True, not momentum=: the strategy "
                             "then accumulates the wrapped optimizer's own momentum (DGC's momentum correction; a "
                             "strategy instance, e.g. hvdx.comm.HiTopK(momentum=0.9), takes it directly)")
        self._ready = False
        tf.keras.optimizers.Optimizer.__init__(self, name=name or f"Distributed{type(optimizer).__name__}")
        self._momentum = Momentum(optimizer)
        self._optimizer = optimizer
        traits = traits_of(optimizer)
        _check_local_trust_ratio(local_trust_ratio, optimizer, traits)
        if trust_norms not in lars.NORMS:
            raise ValueError(f"trust_norms must be one of {', '.join(map(repr, lars.NORMS))}, got {trust_norms!r}")
        self._trust_norms = trust_norms
        momentum = _corrected_momentum(optimizer, momentum_correction)
        self._aggregator = GradientAggregator(
            communication, bucket_bytes=bucket_bytes, op=op, gradient_predivide_factor=gradient_predivide_factor,
            compression=compression, sparse_as_dense=sparse_as_dense, process_set=process_set,
            groups=groups, num_groups=num_groups,
            scale_local_gradients=scale_local_gradients, device_dense=device_dense, device_sparse=device_sparse,
            traits=traits, wrapper_aids=dict(momentum_correction=momentum_correction,
                                             local_trust_ratio=local_trust_ratio),
            **strategy_options, **({} if momentum is None else {"momentum": momentum}))
        self._check_momentum_correction()
        self._local_trust = self._resolve_local_trust(strict=True)
        self._agg_helper = local_accumulator(backward_passes_per_step, average_aggregated_gradients)
        self._horovod_config = dict(
            device_dense=device_dense, device_sparse=device_sparse, compression=_compression_name(compression)
            if compression in _COMPRESSIONS.values() else None, sparse_as_dense=bool(sparse_as_dense),
            gradient_predivide_factor=float(gradient_predivide_factor),
            op=OP_NAMES[op], backward_passes_per_step=self._agg_helper.passes if self._agg_helper else 1,
            average_aggregated_gradients=bool(average_aggregated_gradients),
            num_groups=self._aggregator.num_groups,
            scale_local_gradients=bool(scale_local_gradients))
        self._just_aggregated: Optional[List[Any]] = None
        self._ready = True

    # -- what the wrapper is -----------------------------------------------------------
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
        (hvdx.callbacks.SwitchCommunication does that for Model.fit). The options given at
        construction that apply to it are kept, and a name gets the aids it decides for the
        wrapped optimizer (momentum correction, the Adam density warm-up, LARS' local trust
        ratio), as if it had been the first, unless the constructor's arguments said
        otherwise (`hvdx.comm.choice.StrategyChoice.switch`)."""
        self._aggregator.switch(communication, traits_of(self._optimizer))
        self._check_momentum_correction()
        self._local_trust = self._resolve_local_trust(strict=False)

    @property
    def local_trust_ratio(self) -> bool:
        """Whether the wrapped LARS' trust ratio is applied to each rank's gradient before the
        strategy (on only while the strategy is a sparse one)."""
        return self._local_trust

    def _resolve_local_trust(self, strict: bool) -> bool:
        """local_trust_ratio with the current strategy: as given, else the strategy's default
        (`StrategyChoice.aid`), on only with a lossy strategy; `strict`: an explicit True with
        a dense one is refused (ValueError)."""
        on = self._aggregator.choice.aid("local_trust_ratio")
        if on and not self._aggregator.strategy.lossy:
            if strict:
                raise ValueError(f"local_trust_ratio=True applies LARS' trust ratio before a sparse strategy; "
                                 f"{self._aggregator.strategy!r} is dense (the trust ratio is applied after it "
                                 "anyway): leave local_trust_ratio unset, or use communication='hitopk'")
            return False
        return on

    def _check_momentum_correction(self) -> None:
        """A strategy with momentum correction needs a wrapped optimizer whose momentum the
        wrapper can set to 0 in the step (else momentum would be applied twice)."""
        try:
            inner = float(getattr(self._optimizer, "momentum", 0.0) or 0.0)
        except (TypeError, ValueError):
            inner = 1.0  # a momentum the wrapper cannot read as a number
        if getattr(self._aggregator.strategy, "momentum", 0.0) and not self._momentum.held and inner:
            raise ValueError(f"{self._aggregator.strategy!r} applies momentum correction, but the wrapper cannot set "
                             f"the momentum of {type(self._optimizer).__name__} to 0 in its step: use "
                             "tf.keras.optimizers.SGD (not legacy), or an optimizer without momentum")

    def register_local_var(self, var) -> None:
        """Horovod's: the gradient of `var` is not aggregated (divided by the number of ranks
        when scale_local_gradients)."""
        self._aggregator.register_local_var(var)

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: the wrapped optimizer's hyper-parameters
        # (momentum, beta_1, ...) read through the wrapper, as Horovod's callbacks do.
        inner = self.__dict__.get("_optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    # -- the step ----------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def _aggregate(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        return aggregate_passes(self._agg_helper, self._aggregate_and_observe, grads, variables)

    def _aggregate_and_observe(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        """The aggregated gradients; the aggregation's record goes to a wrapped
        `AggregationObserver` (LARS / LAMB compute their layer norms on the strategy's
        reduce-scattered slices)."""
        if self._local_trust:  # LARS' eq. 11 on this rank's gradient, before the strategy accumulates it
            grads = self._optimizer.local_trusted(list(grads), list(variables), norms=self._trust_norms,
                                                  process_set=self._aggregator.process_set)
        aggregated = self._aggregator(grads, variables)
        if isinstance(self._optimizer, AggregationObserver) and self._aggregator.last_aggregation is not None:
            self._optimizer.observe_aggregation(self._aggregator.last_aggregation)
        return aggregated

    @tf.autograph.experimental.do_not_convert
    def compute_gradients(self, loss, var_list, tape=None, grad_loss=None):
        """Keras' contract: this rank's gradients (aggregation happens at the hook)."""
        if _is_legacy(self._optimizer):
            return list(self._optimizer._compute_gradients(loss, var_list, grad_loss, tape=tape))
        return list(self._optimizer.compute_gradients(loss, var_list, tape=tape))

    @tf.autograph.experimental.do_not_convert
    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's contract: gradients already aggregated over the ranks. A following
        apply_gradients of exactly these gradients does not aggregate them again."""
        grads_and_vars = self.compute_gradients(loss, var_list, tape=tape or tf.GradientTape(), grad_loss=grad_loss)
        grads = self._aggregate([g for g, _ in grads_and_vars], [v for _, v in grads_and_vars])
        self._just_aggregated = grads
        return list(zip(grads, [v for _, v in grads_and_vars]))

    @tf.autograph.experimental.do_not_convert
    def get_gradients(self, loss, params):
        """Horovod's (Keras v1) contract: aggregated gradients of `loss`."""
        grads = tf.gradients(loss, params)
        return self._aggregate(grads, params)

    @tf.autograph.experimental.do_not_convert
    def aggregate_gradients(self, grads_and_vars):
        """Keras' hook (called by apply_gradients, and by LossScaleOptimizer before its
        finiteness check): the gradients aggregated over the ranks."""
        grads_and_vars = list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        if self._just_aggregated is not None and len(grads) == len(self._just_aggregated) and all(
                a is b for a, b in zip(grads, self._just_aggregated)):
            self._just_aggregated = None  # from _compute_gradients: aggregated already
            return grads_and_vars
        self._just_aggregated = None
        variables = [v for _, v in grads_and_vars]
        return list(zip(self._aggregate(grads, variables), variables))

    _aggregate_gradients = aggregate_gradients  # the legacy optimizers' name of the hook

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation: bool = False, **kwargs):
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        if not grads_and_vars:  # nothing to apply (no trainable variables, or no gradients)
            return None
        aggregate = kwargs.pop("experimental_aggregate_gradients", True) and not skip_gradients_aggregation
        if aggregate:
            grads_and_vars = self.aggregate_gradients(grads_and_vars)
        self._just_aggregated = None
        # Momentum correction (DGC): the strategy accumulated the velocity, so the wrapped
        # optimizer applies the aggregate without a momentum of its own.
        corrected = bool(getattr(self._aggregator.strategy, "momentum", 0.0))
        trusted = self._optimizer.trust_applied(True) if self._local_trust else contextlib.nullcontext()
        if self._agg_helper is None:
            with self._momentum.read_by_step(zero=corrected), trusted:  # the step reads the momentum variable
                return self._apply(grads_and_vars)

        def skip():
            return self.iterations.assign_add(1)

        with self._momentum.read_by_step(zero=corrected), trusted:
            return tf.cond(self._agg_helper.applies_now(), lambda: self._apply(grads_and_vars), skip)

    def _apply(self, grads_and_vars):
        if _is_legacy(self._optimizer):
            update = self._optimizer.apply_gradients(grads_and_vars, experimental_aggregate_gradients=False)
        else:
            update = self._optimizer.apply_gradients(grads_and_vars, skip_gradients_aggregation=True)
        return update if update is not None else self.iterations

    @tf.autograph.experimental.do_not_convert
    def minimize(self, loss, var_list, tape=None):
        grads_and_vars = self.compute_gradients(loss, var_list, tape=tape)
        return self.apply_gradients(grads_and_vars)

    # -- state -------------------------------------------------------------------------
    def build(self, var_list):
        """Builds the wrapped optimizer's state, and the residuals once hvdx.init() has run."""
        if _is_legacy(self._optimizer):
            self._optimizer._create_all_weights(var_list)
        else:
            self._optimizer.build(var_list)
        from hvdx.topology import initialized

        if initialized():
            with tf.init_scope():
                self._aggregator.build(var_list)

    @property
    def variables(self):
        """The wrapped optimizer's variables: what Horovod's callbacks broadcast. The
        residuals are per rank (they are checkpointed, never broadcast): `.aggregator`."""
        inner = self._optimizer.variables
        return _CallableList(inner() if callable(inner) else inner)

    def get_weights(self):
        """The wrapped optimizer's state as arrays (in the order `variables` lists it)."""
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights):
        """Keras' .h5 loader sets the wrapped optimizer's state through this."""
        variables = self.variables
        if len(weights) != len(variables):
            raise ValueError(f"{len(weights)} values for the {len(variables)} variables of {self._optimizer.name}")
        for variable, value in zip(variables, weights):
            if tuple(variable.shape) != tuple(getattr(value, "shape", ())):
                raise ValueError(f"optimizer variable {variable.name} has shape {variable.shape}, "
                                 f"the saved value {getattr(value, 'shape', ())}")
            variable.assign(value)

    def save_own_variables(self, store):
        """Keras .keras format: the residuals with their owners (Keras saves a new-style
        wrapped optimizer's variables itself, under inner_optimizer; a legacy one's here)."""
        if _is_legacy(self._optimizer):
            for i, value in enumerate(self.get_weights()):
                store[f"inner.{i}"] = value
        for m, memory in enumerate(self._aggregator._memories):
            for key, value in memory.state().items():
                store[f"m{m}.{memory.name}.{key}"] = value

    def load_own_variables(self, store):
        keys = list(store.keys())
        inner = sorted((k for k in keys if k.startswith("inner.")), key=lambda k: int(k.split(".")[1]))
        if inner:
            self.set_weights([store[k][...] for k in inner])
        by_memory: dict = {}
        for key in keys:
            if key.startswith("inner."):
                continue
            m, memory_name, item = key.split(".", 2)
            by_memory.setdefault((int(m[1:]), memory_name), {})[item] = store[key][...]
        memories = self._aggregator._memories
        for (m, memory_name), state in sorted(by_memory.items()):
            if m < len(memories) and memories[m].name == memory_name:
                memories[m].restore(state)

    @property
    def iterations(self):
        return self._optimizer.iterations

    @iterations.setter
    def iterations(self, variable):
        if getattr(self, "_ready", False):
            self._optimizer.iterations = variable
        else:  # the base constructor sets its own counter first
            self._iterations = variable

    @property
    def momentum(self):
        """The wrapped optimizer's momentum: a variable its step reads where it holds a number
        (Keras' SGD, hvdx's LARS; hvdx.wrapped.Momentum), so Horovod's LR callbacks can assign it."""
        return self._momentum.get()

    @momentum.setter
    def momentum(self, value) -> None:
        self._momentum.set(value)

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        if getattr(self, "_ready", False):
            self._optimizer.learning_rate = value

    def get_config(self):
        if self._horovod_config["compression"] is None:
            raise ValueError("an optimizer with a custom compression cannot be serialised")
        config = {"optimizer": tf.keras.optimizers.serialize(self._optimizer), "name": self.name,
                  **self._horovod_config}
        if self._aggregator.groups_are_variables:
            config["num_groups"] = 0  # variable groups cannot be saved: one bucket on reload
        config.update(self._aggregator.config)
        strategy = self._aggregator.strategy
        if strategy.lossy:  # explicit, so that a reload does not apply other defaults
            config["momentum_correction"] = bool(getattr(strategy, "momentum", 0.0))
            config["local_trust_ratio"] = self._local_trust
            config["trust_norms"] = self._trust_norms
        config.update(self._aggregator.choice.pinned(strategy, config))
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = copy.deepcopy(config)  # never mutate the caller's dict (Keras' deserialize would)
        config["optimizer"] = tf.keras.optimizers.deserialize(config["optimizer"], custom_objects=custom_objects)
        config["compression"] = _COMPRESSIONS[config.get("compression") or "none"]
        config["op"] = {name: op for op, name in OP_NAMES.items()}[config.get("op") or "Average"]
        if config.get("wire_dtype") is not None:
            config["wire_dtype"] = tf.as_dtype(config["wire_dtype"])
        optimizer = config.pop("optimizer")
        # A strategy with momentum correction saved its momentum (the wrapper takes
        # momentum_correction, not momentum=): it is rebuilt from its config, an instance.
        strategy = comm.strategy_class(config.get("communication") or "allreduce")
        if "momentum" in config and "momentum" in strategy.options:
            config.pop("momentum_correction", None)  # the instance carries its momentum
            config["communication"] = strategy.from_config(
                {k: config.pop(k) for k in strategy.options if k in config and k not in HOROVOD_OPTIONS})
        return cls(optimizer, **config)


#: Re-exported: the sparse strategies' default rules (`hvdx.comm.sparse.TopKStrategy.defaults_for`).
AUTO_MOMENTUM_CORRECTION_DENSITY = sparse.AUTO_MOMENTUM_CORRECTION_DENSITY
LARS_MOMENTUM_CORRECTION_DENSITY = sparse.LARS_MOMENTUM_CORRECTION_DENSITY
ADAM_WARMUP_STEPS = sparse.ADAM_WARMUP_STEPS


def _corrected_momentum(optimizer, momentum_correction: Optional[bool]) -> Optional[float]:
    """The momentum the strategy accumulates with when momentum_correction=True is given (DGC's
    momentum correction): the wrapped optimizer's own, which the wrapper then sets to 0 in
    its step; None when not asked.

    Raises:
      ValueError: momentum_correction is not True, False or None; True for an optimizer whose
        momentum is not a number in (0, 1), or is Nesterov's.
    """
    if momentum_correction is not None and not isinstance(momentum_correction, bool):
        raise ValueError(f"momentum_correction must be True or False, got {momentum_correction!r}")
    if not momentum_correction:
        return None
    number = getattr(optimizer, "momentum", None)
    if plain_number(number) is None or not 0 < number < 1 or getattr(optimizer, "nesterov", False):
        raise ValueError(f"momentum_correction=True moves the momentum of an SGD-like optimizer into the sparse "
                         f"strategy (DGC); {type(optimizer).__name__} has momentum={number!r}"
                         f"{' with nesterov=True' if getattr(optimizer, 'nesterov', False) else ''}. Use e.g. "
                         "tf.keras.optimizers.SGD(lr, momentum=0.9), or leave momentum_correction off")
    return float(number)


def _check_local_trust_ratio(given: Optional[bool], optimizer, traits: OptimizerTraits) -> None:
    """local_trust_ratio as given: None, True or False; True only for an optimizer whose
    trust ratio measures the gradient (hvdx's LARS with classic momentum).

    Raises:
      ValueError: naming the fix.
    """
    if given is None:
        return
    if not isinstance(given, bool):
        raise ValueError(f"local_trust_ratio must be True, False or None (the default), got {given!r}")
    if given and traits.trust_ratio != "gradient":
        classic = " with classic_momentum=False" if hasattr(optimizer, "classic_momentum") else ""
        raise ValueError(f"local_trust_ratio=True applies LARS' trust ratio (eq. 11) to each rank's gradient; "
                         f"{type(optimizer).__name__}{classic} has none to apply there: use "
                         "hvdx.optimizers.LARS(..., classic_momentum=True), or leave local_trust_ratio unset")


def PartialDistributedOptimizer(optimizer, name: Optional[str] = None, local_layers=None, **kwargs):
    """Horovod's PartialDistributedOptimizer: the variables of `local_layers` keep their
    local gradients (see `register_local_var`); everything else is aggregated."""
    opt = DistributedOptimizer(optimizer, name, **kwargs)
    for layer in local_layers or ():
        for variable in layer.trainable_weights:
            opt.register_local_var(variable)
    return opt
