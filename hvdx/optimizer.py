"""hvdx.DistributedOptimizer: Horovod's Keras optimizer wrapper, with hvdx's strategies.

    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))                   # = Horovod
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="hitopk",
                                    density=0.01)                                    # sparse

The arguments are Horovod's, in Horovod's order, followed by hvdx's keyword-only ones.
Aggregation runs at Keras' gradient-aggregation hook (`aggregate_gradients`), which a
LossScaleOptimizer (mixed precision) calls before its finiteness check: every rank decides
on the same averaged gradients, so no rank skips a step the others take.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, Dict, List, Optional, Sequence, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import comm
from hvdx.accumulation import LocalAccumulator, aggregate_passes
from hvdx.aggregator import AUTO_BUCKET_BYTES, GradientAggregator
from hvdx.buckets import AggregationObserver
from hvdx.comm.base import HOROVOD_OPTIONS
from hvdx.comm.dense import OP_NAMES
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
        (2DTAR), "hitopk" (HiTopKComm) or "sparse_allgather" (NaiveAG), or an
        hvdx.comm.Strategy. $HVDX_COMMUNICATION / $HVDX_DENSITY change the default.
      density, num_samplings: MSTopK's options for the sparse strategies (density 0.01 by
        default there; rejected with a dense strategy).
      wire_dtype: the type values travel in (float32, float16, bfloat16).
      bucket_bytes: gradients are fused into buckets, filled from the last layer to the
        first, each closed once it holds this many bytes; a bucket's collectives start
        while backpropagation goes on. "auto" (default): the strategy's own size
        (`Strategy.bucket_bytes`: 32 MiB; 4 MiB for "hierarchical"). None: one buffer per
        dtype.
      Deep Gradient Compression's aids for the sparse strategies (`hvdx.comm.dgc`;
      rejected with a dense one): momentum_correction (the wrapped SGD's momentum is
      accumulated by the strategy before selection, with momentum factor masking, and the
      wrapped optimizer applies the aggregate without momentum; None, the default: on for
      a sparse strategy named at density <= 0.1 with Keras' SGD with momentum), clip_norm (local gradient
      clipping to clip_norm / sqrt(ranks)), warmup_steps / warmup_density (the density falls
      exponentially from warmup_density, 0.25, to density over the first warmup_steps
      steps; None, the default: 100 for an Adam-family optimizer with a sparse strategy
      named, else off), residual_decay (error feedback keeps residual_decay x the residual).
      local_trust_ratio: hvdx's LARS only: eq. 11's trust ratio is applied to each rank's
        gradient before the sparse strategy accumulates it, and the step applies the
        aggregate with ratio 1 (hvdx.optimizers.lars). None, the default: on for LARS
        (classic momentum, not Nesterov) under a sparse strategy named at density <= 0.1, with
        momentum correction at density <= 0.01 (measured); LAMB gets the Adam family's
        density warm-up.

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
                 communication: Union[str, comm.Strategy, None] = None, density: Optional[float] = None,
                 num_samplings: Optional[int] = None, wire_dtype=None,
                 bucket_bytes: Union[int, None, str] = AUTO_BUCKET_BYTES, momentum_correction: Optional[bool] = None,
                 clip_norm: Optional[float] = None, warmup_steps: Optional[int] = None,
                 warmup_density: Optional[float] = None, residual_decay: Optional[float] = None,
                 local_trust_ratio: Optional[bool] = None) -> None:
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
        self._ready = False
        tf.keras.optimizers.Optimizer.__init__(self, name=name or f"Distributed{type(optimizer).__name__}")
        self._momentum = Momentum(optimizer)
        self._optimizer = optimizer
        self._aid_args = dict(momentum_correction=momentum_correction, warmup_steps=warmup_steps, density=density,
                              local_trust_ratio=local_trust_ratio)
        aids = dict(clip_norm=clip_norm, warmup_density=warmup_density, residual_decay=residual_decay,
                    **self._default_aids(communication))
        self._aggregator = GradientAggregator(
            communication, density=density, num_samplings=num_samplings, wire_dtype=wire_dtype,
            bucket_bytes=bucket_bytes, op=op, gradient_predivide_factor=gradient_predivide_factor,
            compression=compression, sparse_as_dense=sparse_as_dense, process_set=process_set,
            groups=groups, num_groups=num_groups,
            scale_local_gradients=scale_local_gradients, device_dense=device_dense, device_sparse=device_sparse,
            aids=aids)
        self._check_momentum_correction()
        self._local_trust = self._resolve_local_trust(communication, strict=True)
        self._agg_helper = (LocalAccumulator(backward_passes_per_step, average_aggregated_gradients)
                            if backward_passes_per_step != 1 else None)
        self._horovod_config = dict(
            device_dense=device_dense, device_sparse=device_sparse, compression=_compression_name(compression)
            if compression in _COMPRESSIONS.values() else None, sparse_as_dense=bool(sparse_as_dense),
            gradient_predivide_factor=float(gradient_predivide_factor),
            op=OP_NAMES[op], backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=bool(average_aggregated_gradients),
            num_groups=groups if isinstance(groups, int) else num_groups,
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
        (hvdx.callbacks.SwitchCommunication does that for Model.fit). A name gets the
        convergence aids it would have had at construction (momentum correction, the Adam
        density warm-up) unless the constructor's arguments said otherwise."""
        defaults = None
        if isinstance(communication, str):
            defaults = {k: v for k, v in self._default_aids(communication).items() if v is not None}
        self._aggregator.switch(communication, defaults)
        self._check_momentum_correction()
        self._local_trust = self._resolve_local_trust(communication, strict=False)

    @property
    def local_trust_ratio(self) -> bool:
        """Whether the wrapped LARS' trust ratio is applied to each rank's gradient before the
        strategy (on only while the strategy is a sparse one)."""
        return self._local_trust

    def _resolve_local_trust(self, communication, strict: bool) -> bool:
        """local_trust_ratio for `communication` (`_local_trust_ratio`), on only with a lossy
        strategy; `strict`: an explicit True with a dense one is refused (ValueError)."""
        on = _local_trust_ratio(self._aid_args["local_trust_ratio"], self._optimizer, communication,
                                self._aid_args["density"])
        if on and not self._aggregator.strategy.lossy:
            if strict:
                raise ValueError(f"local_trust_ratio=True applies LARS' trust ratio before a sparse strategy; "
                                 f"{self._aggregator.strategy!r} is dense (the trust ratio is applied after it "
                                 "anyway): leave local_trust_ratio unset, or use communication='hitopk'")
            return False
        return on

    def _default_aids(self, communication) -> Dict[str, Any]:
        """momentum and warmup_steps for `communication` from the constructor's
        momentum_correction / warmup_steps / density (None: the strategy's own default)."""
        given = self._aid_args  # (local_trust_ratio itself: `_resolve_local_trust`, the wrapper's side)
        trusted = _local_trust_ratio(given["local_trust_ratio"], self._optimizer, communication, given["density"])
        return dict(
            warmup_steps=_warmup_steps(given["warmup_steps"], self._optimizer, communication, given["density"]),
            momentum=_corrected_momentum(self._optimizer, _momentum_correction(
                given["momentum_correction"], self._optimizer, communication, given["density"], trusted)))

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
            grads = self._optimizer.local_trusted(list(grads), list(variables))
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
        if strategy.lossy:  # explicit, so that a reload does not apply other defaults (`_momentum_correction`)
            config.setdefault("warmup_steps", getattr(strategy, "warmup_steps", 0))
            config["momentum_correction"] = bool(getattr(strategy, "momentum", 0.0))
            config["local_trust_ratio"] = self._local_trust
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
        # A registered strategy with options of its own (not keywords of this class) is
        # rebuilt from its config and passed as an instance.
        strategy = comm.strategy_class(config.get("communication") or "allreduce")
        own = [k for k in strategy.options if k in config and k not in _KEYWORDS]
        if own:
            config.pop("momentum_correction", None)  # the instance carries its momentum
            config["communication"] = strategy.from_config(
                {k: config.pop(k) for k in strategy.options if k in config and k not in HOROVOD_OPTIONS})
        return cls(optimizer, **config)


#: Momentum correction is on by default up to this density (its masking presumes a sparse
#: selection: at density 1 it would reset every velocity each step).
AUTO_MOMENTUM_CORRECTION_DENSITY = 0.1
#: For hvdx's LARS (with its local trust ratio) only up to this density: measured on the
#: small ResNet (benchmarks/README.md, convergence.py --optimizer lars), momentum correction
#: helps at density 0.01 (0.829 against 0.501 without, 3 seeds) and hurts above it (0.02:
#: 0.573 against 0.642, one seed; 0.05: 0.391 against 0.900, 3 seeds).
LARS_MOMENTUM_CORRECTION_DENSITY = 0.01


def _classic_lars(optimizer) -> bool:
    """Whether `optimizer` is hvdx's LARS with eq. 11's classic momentum (its trust ratio
    measures the gradient, so it can be applied before aggregation)."""
    from hvdx.optimizers.lars import LARS

    return isinstance(optimizer, LARS) and optimizer.classic_momentum


def _momentum_correction(given: Optional[bool], optimizer, communication, density: Optional[float],
                         local_trust: bool = False) -> bool:
    """Whether to apply DGC's momentum correction: as `given`, or by default (None) when a
    sparse strategy is named (or is $HVDX_COMMUNICATION's) at a density up to
    AUTO_MOMENTUM_CORRECTION_DENSITY and the wrapped optimizer is Keras' SGD, or hvdx's LARS
    with its `local_trust` ratio on (`_local_trust_ratio`; without it momentum correction
    is LARS' worst case: the trust ratio would normalise the accumulated velocity) up to
    LARS_MOMENTUM_CORRECTION_DENSITY, with a momentum, not Nesterov's (measured:
    benchmarks/README.md, convergence.py)."""
    if given is not None:
        return given
    density = _sparse_density(communication, density)
    if density is None:
        return False
    number = getattr(optimizer, "momentum", None)
    lars = local_trust and _classic_lars(optimizer)
    limit = LARS_MOMENTUM_CORRECTION_DENSITY if lars else AUTO_MOMENTUM_CORRECTION_DENSITY
    return ((type(optimizer) is tf.keras.optimizers.SGD or lars)
            and isinstance(number, (int, float))
            and not isinstance(number, bool) and 0 < number < 1 and not getattr(optimizer, "nesterov", False)
            and isinstance(density, (int, float)) and density <= limit)


#: The density warm-up an Adam-family optimizer gets by default with a sparse strategy
#: (measured: benchmarks/README.md, convergence.py): 4 stages of 25 steps from 25 %.
ADAM_WARMUP_STEPS = 100
_ADAM_FAMILY = (tf.keras.optimizers.Adam, tf.keras.optimizers.AdamW, tf.keras.optimizers.Adamax,
                tf.keras.optimizers.Nadam, tf.keras.optimizers.legacy.Adam, tf.keras.optimizers.legacy.Adamax,
                tf.keras.optimizers.legacy.Nadam)


def _adam_family(optimizer) -> bool:
    """Keras' Adam-family optimizers and hvdx's LAMB (Adam's moments with a layer-wise rate)."""
    from hvdx.optimizers.lamb import LAMB

    return isinstance(optimizer, _ADAM_FAMILY + (LAMB,))


def _local_trust_ratio(given: Optional[bool], optimizer, communication, density: Optional[float]) -> bool:
    """Whether LARS' trust ratio is applied to each rank's gradient before the strategy
    (hvdx.optimizers.lars): as `given`, or by default (None) for hvdx's LARS with classic
    momentum under a sparse strategy named (or $HVDX_COMMUNICATION's) at a density up to
    AUTO_MOMENTUM_CORRECTION_DENSITY, the same condition as its momentum correction.

    Raises:
      ValueError: `given` is not None, True or False, or True for an optimizer other than
        LARS with classic momentum.
    """
    if given is None:
        density = _sparse_density(communication, density)
        return (density is not None and isinstance(density, (int, float))
                and density <= AUTO_MOMENTUM_CORRECTION_DENSITY and _classic_lars(optimizer))
    if not isinstance(given, bool):
        raise ValueError(f"local_trust_ratio must be True, False or None (the default), got {given!r}")
    if given and not _classic_lars(optimizer):
        raise ValueError(f"local_trust_ratio=True applies LARS' trust ratio (eq. 11) to each rank's gradient; "
                         f"{type(optimizer).__name__}{'' if not hasattr(optimizer, 'classic_momentum') else ' with classic_momentum=False'} "
                         "has none to apply there: use hvdx.optimizers.LARS(..., classic_momentum=True), or leave "
                         "local_trust_ratio unset")
    return given


def _sparse_density(communication, density: Optional[float]) -> Optional[float]:
    """The density of the sparse strategy named by `communication` (or $HVDX_COMMUNICATION),
    None if it names no sparse strategy."""
    from hvdx.aggregator import default_communication

    if communication is None:
        communication, env_density = default_communication()
        density = density if density is not None else env_density
    if not isinstance(communication, str) or not comm.is_name(communication) \
            or not comm.strategy_class(communication).lossy:
        return None
    return comm.DEFAULT_DENSITY if density is None else density


def _warmup_steps(given: Optional[int], optimizer, communication, density: Optional[float]) -> Optional[int]:
    """The density warm-up: as `given`, or by default (None) ADAM_WARMUP_STEPS for an
    Adam-family optimizer (hvdx's LAMB included) with a sparse strategy named at a density below the warm-up's
    start (0.25); None (the strategy's own default, off) otherwise."""
    if given is not None:
        return given
    density = _sparse_density(communication, density)
    if density is None or not isinstance(density, (int, float)) or density >= 0.25 \
            or not _adam_family(optimizer):
        return None
    return ADAM_WARMUP_STEPS


def _corrected_momentum(optimizer, momentum_correction: bool) -> Optional[float]:
    """The momentum the strategy accumulates with (DGC's momentum correction): the wrapped
    optimizer's, which then applies the aggregate without one; None when not asked."""
    if not isinstance(momentum_correction, bool):
        raise ValueError(f"momentum_correction must be True or False, got {momentum_correction!r}")
    if not momentum_correction:
        return None
    number = getattr(optimizer, "momentum", None)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 < number < 1 \
            or getattr(optimizer, "nesterov", False):
        raise ValueError(f"momentum_correction=True moves the momentum of an SGD-like optimizer into the sparse "
                         f"strategy (DGC); {type(optimizer).__name__} has momentum={number!r}"
                         f"{' with nesterov=True' if getattr(optimizer, 'nesterov', False) else ''}. Use e.g. "
                         "tf.keras.optimizers.SGD(lr, momentum=0.9), or leave momentum_correction off")
    return float(number)


_KEYWORDS = frozenset(inspect.signature(DistributedOptimizer.__init__).parameters)


def PartialDistributedOptimizer(optimizer, name: Optional[str] = None, local_layers=None, **kwargs):
    """Horovod's PartialDistributedOptimizer: the variables of `local_layers` keep their
    local gradients (see `register_local_var`); everything else is aggregated."""
    opt = DistributedOptimizer(optimizer, name, **kwargs)
    for layer in local_layers or ():
        for variable in layer.trainable_weights:
            opt.register_local_var(variable)
    return opt
