"""What hvdx's optimizer wrappers share, whatever the Keras: the Keras-neutral core below
the per-Keras adapters (`hvdx/optimizer.py` for Keras 2 / tf_keras, `hvdx/keras3_optimizer.py`
for Keras 3).

- Which Keras an optimizer is of (`is_keras3_optimizer`), read from its class without
  importing either Keras.
- The checks of the wrapper's own arguments (`corrected_momentum`, `check_local_trust_ratio`,
  `compression_name`, `COMPRESSIONS`) and the translation of a saved config back into them
  (`arguments_from_config`).
- `WrapperCore`: the aggregator built from Horovod's and hvdx's arguments, the local
  accumulation (`backward_passes_per_step`), the aids the wrapper applies around the
  strategy (LARS' local trust ratio, whether momentum correction is on), the aggregation of
  one step, the config, and the residuals as arrays for a Keras archive.
- `passing_subclass`: the class that lets a wrapper pass for the optimizer it wraps
  (`isinstance(opt, SGD)`), given the Keras base class both share; each adapter registers
  and caches it for its Keras.

Nothing here imports Keras; the adapters give it the Keras objects it needs.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdx import comm
from hvdx.accumulation import LocalAccumulator, aggregate_passes, local_accumulator
from hvdx.aggregator import AUTO_BUCKET_BYTES, GradientAggregator
from hvdx.buckets import AggregationObserver
from hvdx.comm.allreduce import OP_NAMES
from hvdx.comm.base import HOROVOD_OPTIONS
from hvdx.comm.traits import OptimizerTraits, plain_number
from hvdx.optimizers import lars

__all__ = ["COMPRESSIONS", "WrapperCore", "arguments_from_config", "check_local_trust_ratio", "compression_name",
           "corrected_momentum", "is_keras3_optimizer", "is_keras3_variable", "passing_subclass", "residual_state", "restore_residuals"]

#: The compressions a config can name.
COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}

# Class attributes that make up the class itself, never copied into a subclass.
_STRUCTURAL = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__slots__",
                         "__annotations__", "__abstractmethods__", "_abc_impl", "__orig_bases__", "__parameters__"})


#: The classes `subclass_for` made, one per (wrapper, wrapped) pair, whatever the Keras.
_MADE: Dict[Tuple[type, type], type] = {}
_LOCK = threading.Lock()

def is_keras3_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is a Keras 3 optimizer (`keras.optimizers.*` from the Keras 3
    package, or tf.keras's where tf.keras is Keras 3): its class derives from Keras 3's
    `keras.src.optimizers.base_optimizer.BaseOptimizer`. Keras 2's (tf_keras, or the keras
    2.x package of TensorFlow 2.15) derive from a `_BaseOptimizer` of their own. Imports no Keras."""
    return any(cls.__name__ == "BaseOptimizer" and (cls.__module__ or "") == "keras.src.optimizers.base_optimizer"
               for cls in type(optimizer).__mro__)


def is_keras3_variable(variable: Any) -> bool:
    """Whether `variable` is a Keras 3 variable (a Keras 3 model's or optimizer's: its class
    derives from `keras.src.backend.common.variables.Variable`). Imports no Keras."""
    return any(cls.__name__ == "Variable" and (cls.__module__ or "") == "keras.src.backend.common.variables"
               for cls in type(variable).__mro__)


def compression_name(compression) -> str:
    """The name of Horovod's `compression` in a config.

    Raises:
      ValueError: a compression other than none and fp16 (not serialisable).
    """
    for name, value in COMPRESSIONS.items():
        if compression is value:
            return name
    raise ValueError(f"compression {compression!r} cannot be saved in a config (only none and fp16 can)")


def corrected_momentum(optimizer, momentum_correction: Optional[bool], example: str) -> Optional[float]:
    """The momentum the strategy accumulates with when momentum_correction=True is given (DGC's
    momentum correction): the wrapped optimizer's own, which the wrapper then sets to 0 in
    its step; None when not asked.

    Args:
      optimizer: the wrapped optimizer.
      momentum_correction: True, False or None, as given.
      example: an optimizer that takes it, for the message ("tf.keras.optimizers.SGD(lr, momentum=0.9)").
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
                         f"{example}, or leave momentum_correction off")
    return float(number)


def check_local_trust_ratio(given: Optional[bool], optimizer, traits: OptimizerTraits) -> None:
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


def arguments_from_config(config: Mapping[str, Any]) -> Dict[str, Any]:
    """The wrapper's keyword arguments from what `WrapperCore.config` saved (a copy: the
    caller's dict is never changed), without "optimizer": Horovod's compression and op by
    their names, the wire dtype, and a strategy with momentum correction rebuilt as an
    instance from its config (the wrapper takes momentum_correction=, not momentum=)."""
    config = copy.deepcopy(dict(config))
    config.pop("optimizer", None)
    config["compression"] = COMPRESSIONS[config.get("compression") or "none"]
    config["op"] = {name: op for op, name in OP_NAMES.items()}[config.get("op") or "Average"]
    if config.get("wire_dtype") is not None:
        config["wire_dtype"] = tf.as_dtype(config["wire_dtype"])
    strategy = comm.strategy_class(config.get("communication") or "allreduce")
    if "momentum" in config and "momentum" in strategy.options:
        config.pop("momentum_correction", None)  # the instance carries its momentum
        config["communication"] = strategy.from_config(
            {k: config.pop(k) for k in strategy.options if k in config and k not in HOROVOD_OPTIONS})
    return config


def aggregate_and_observe(optimizer: Any, aggregator: GradientAggregator, grads: List[Any], variables: List[Any],
                          local_trust: bool, trust_norms: str) -> List[Any]:
    """`grads` aggregated by `aggregator`: with `local_trust` first scaled by the wrapped LARS'
    trust ratio (eq. 11, `norms=trust_norms`) on this rank, before the strategy accumulates
    them; the aggregation's record then goes to a wrapped `AggregationObserver` (LARS / LAMB
    compute their layer norms on the strategy's reduce-scattered slices)."""
    if local_trust:
        grads = optimizer.local_trusted(list(grads), list(variables), norms=trust_norms,
                                        process_set=aggregator.process_set)
    aggregated = aggregator(grads, variables)
    if isinstance(optimizer, AggregationObserver) and aggregator.last_aggregation is not None:
        optimizer.observe_aggregation(aggregator.last_aggregation)
    return aggregated


def check_name(name: Any) -> None:
    """Horovod's order puts the optimizer's name second: a strategy there is a mistake.

    Raises:
      ValueError: naming the keyword to use.
    """
    if isinstance(name, comm.Strategy) or comm.is_name(name):
        raise ValueError(f"the second argument is the optimizer's name (Horovod's order); pass the strategy "
                         f"as communication={name!r}")


class WrapperCore:
    """The Keras-neutral part of an optimizer wrapper around `optimizer`.

    Args:
      optimizer: the wrapped optimizer (its momentum, nesterov, LARS' local trust ratio and
        `AggregationObserver` are read here; nothing else).
      traits: its `OptimizerTraits` (the adapter knows its Keras' classes).
      example: an optimizer of that Keras with momentum, for messages.
      Horovod's and hvdx's arguments: as `hvdx.DistributedOptimizer` documents them.
    Raises:
      ValueError: a bad argument, naming the fix (momentum=, local_trust_ratio=, trust_norms=,
        momentum_correction=, and whatever `GradientAggregator` refuses).
    """

    def __init__(self, optimizer, traits: OptimizerTraits, *, example: str, device_dense: str = "",
                 device_sparse: str = "", compression=hvd.Compression.none, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, op=hvd.Average, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                 process_set: hvd.ProcessSet = hvd.global_process_set, scale_local_gradients: bool = True,
                 communication: Union[str, comm.Strategy, None] = None,
                 bucket_bytes: Union[int, None, str] = AUTO_BUCKET_BYTES, momentum_correction: Optional[bool] = None,
                 local_trust_ratio: Optional[bool] = None, trust_norms: str = "average",
                 **strategy_options: Any) -> None:
        if strategy_options.get("momentum") is not None:  # the strategy's momentum is the wrapped optimizer's
            raise ValueError("hvdx.DistributedOptimizer takes momentum_correction=True, not momentum=: the strategy "
                             "then accumulates the wrapped optimizer's own momentum (DGC's momentum correction; a "
                             "strategy instance, e.g. hvdx.comm.HiTopK(momentum=0.9), takes it directly)")
        self.optimizer = optimizer
        self.traits = traits
        check_local_trust_ratio(local_trust_ratio, optimizer, traits)
        if trust_norms not in lars.NORMS:
            raise ValueError(f"trust_norms must be one of {', '.join(map(repr, lars.NORMS))}, got {trust_norms!r}")
        self.trust_norms = trust_norms
        momentum = corrected_momentum(optimizer, momentum_correction, example)
        self.aggregator = GradientAggregator(
            communication, bucket_bytes=bucket_bytes, op=op, gradient_predivide_factor=gradient_predivide_factor,
            compression=compression, sparse_as_dense=sparse_as_dense, process_set=process_set,
            groups=groups, num_groups=num_groups,
            scale_local_gradients=scale_local_gradients, device_dense=device_dense, device_sparse=device_sparse,
            traits=traits, wrapper_aids=dict(momentum_correction=momentum_correction,
                                             local_trust_ratio=local_trust_ratio),
            **strategy_options, **({} if momentum is None else {"momentum": momentum}))
        self.local_trust = self.resolve_local_trust(strict=True)
        self.accumulator: Optional[LocalAccumulator] = local_accumulator(backward_passes_per_step,
                                                                         average_aggregated_gradients)
        self.horovod_config = dict(
            device_dense=device_dense, device_sparse=device_sparse, compression=compression_name(compression)
            if compression in COMPRESSIONS.values() else None, sparse_as_dense=bool(sparse_as_dense),
            gradient_predivide_factor=float(gradient_predivide_factor),
            op=OP_NAMES[op], backward_passes_per_step=self.accumulator.passes if self.accumulator else 1,
            average_aggregated_gradients=bool(average_aggregated_gradients),
            num_groups=self.aggregator.num_groups,
            scale_local_gradients=bool(scale_local_gradients))

    # -- the aids ----------------------------------------------------------------------
    @property
    def momentum_corrected(self) -> bool:
        """Whether the current strategy applies momentum correction (DGC): the wrapped
        optimizer must then apply the aggregate without a momentum of its own."""
        return self.aggregator.strategy.corrects_momentum

    def resolve_local_trust(self, strict: bool) -> bool:
        """local_trust_ratio with the current strategy: as given, else the strategy's default
        (`StrategyChoice.aid`), on only with a lossy strategy; `strict`: an explicit True with
        a dense one is refused (ValueError)."""
        on = self.aggregator.choice.aid("local_trust_ratio")
        if on and not self.aggregator.strategy.lossy:
            if strict:
                raise ValueError(f"local_trust_ratio=True applies LARS' trust ratio before a sparse strategy; "
                                 f"{self.aggregator.strategy!r} is dense (the trust ratio is applied after it "
                                 "anyway): leave local_trust_ratio unset, or use communication='hitopk'")
            return False
        return on

    def switch(self, communication: Union[str, comm.Strategy], traits: OptimizerTraits) -> None:
        """The aggregator's `switch` with the wrapped optimizer's traits now; the local trust
        ratio resolved again for the new strategy."""
        self.traits = traits
        self.aggregator.switch(communication, traits)
        self.local_trust = self.resolve_local_trust(strict=False)

    # -- the step ----------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def aggregate(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        """The gradients aggregated over the ranks (through the local accumulation where
        backward_passes_per_step > 1: zeros between aggregations)."""
        return aggregate_passes(self.accumulator, self._aggregate_and_observe, grads, variables)

    def _aggregate_and_observe(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        return aggregate_and_observe(self.optimizer, self.aggregator, grads, variables, self.local_trust,
                                     self.trust_norms)

    def applies_now(self) -> Optional[tf.Tensor]:
        """None where every pass applies; else whether this pass applies (the N-th)."""
        return None if self.accumulator is None else self.accumulator.applies_now()

    # -- state -------------------------------------------------------------------------
    def config(self) -> Dict[str, Any]:
        """Horovod's options, the aggregator's, and (for a lossy strategy) the wrapper's aids
        and every option pinned that the strategy's defaults would change on reload.

        Raises:
          ValueError: a custom compression (not serialisable).
        """
        if self.horovod_config["compression"] is None:
            raise ValueError("an optimizer with a custom compression cannot be serialised")
        config = dict(self.horovod_config)
        if self.aggregator.groups_are_variables:
            config["num_groups"] = 0  # variable groups cannot be saved: one bucket on reload
        config.update(self.aggregator.config)
        strategy = self.aggregator.strategy
        if strategy.lossy:  # explicit, so that a reload does not apply other defaults
            config["momentum_correction"] = self.momentum_corrected
            config["local_trust_ratio"] = self.local_trust
            config["trust_norms"] = self.trust_norms
        config.update(self.aggregator.choice.pinned(strategy, config))
        return config

    def residual_state(self) -> Dict[str, np.ndarray]:
        """`residual_state` of this wrapper's aggregator."""
        return residual_state(self.aggregator)

    def restore_residuals(self, keys: Sequence[str], read: Callable[[str], np.ndarray]) -> None:
        """`restore_residuals` into this wrapper's aggregator."""
        restore_residuals(self.aggregator, keys, read)


def residual_state(aggregator: GradientAggregator) -> Dict[str, np.ndarray]:
    """Every strategy's residuals in `aggregator` with their owners, scales and counters, as
    arrays keyed 'm<index>.<memory>.<what>' (per rank: saved with a rank's model, never
    broadcast)."""
    out: Dict[str, np.ndarray] = {}
    for m, memory in enumerate(aggregator._memories):
        for key, value in memory.state().items():
            out[f"m{m}.{memory.name}.{key}"] = value
    return out


def restore_residuals(aggregator: GradientAggregator, keys: Sequence[str], read: Callable[[str], np.ndarray]) -> None:
    """Loads what `residual_state` saved into `aggregator`: `keys` its keys (others are
    ignored), `read(key)` the array. A memory the aggregator's strategies do not have is
    skipped; residuals not created yet get their state when they are."""
    by_memory: Dict[tuple, Dict[str, np.ndarray]] = {}
    for key in keys:
        head, _, rest = key.partition(".")
        if not (head.startswith("m") and head[1:].isdigit() and "." in rest):
            continue
        memory_name, item = rest.split(".", 1)
        by_memory.setdefault((int(head[1:]), memory_name), {})[item] = read(key)
    memories = aggregator._memories
    for (m, memory_name), state in sorted(by_memory.items()):
        if m < len(memories) and memories[m].name == memory_name:
            memories[m].restore(state)


class _FromWrapped:
    """An attribute the wrapped optimizer's class adds to its Keras' Optimizer: read from the
    wrapped optimizer (`inner_optimizer`), never run on the wrapper's state."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return getattr(owner._hvdx_wrapped_class, self._name)
        return getattr(instance.inner_optimizer, self._name)


def subclass_for(wrapper: type, wrapped: type, base: type, registered_name: Callable[[type], str],
                 register: Callable[[str, str], Callable[[type], type]]) -> type:
    """The class of a `wrapper` instance that wraps a `wrapped` instance: `wrapper` itself
    unless `wrapped` is a subclass of `base` (the adapter's Keras Optimizer) and no wrapper,
    else `passing_subclass(wrapper, wrapped)`, made once per pair and registered in the
    adapter's Keras registry (`registered_name(cls)`, `register(package, name)(cls)`) under
    `wrapper`'s name, so that it saves as `wrapper` (whose from_config makes it again). A
    subclass made here passed as `wrapper` stands for the wrapper it was made from."""
    wrapper = vars(wrapper).get("_hvdx_wrapper", wrapper)
    if not issubclass(wrapped, base) or "_hvdx_wrapper" in vars(wrapped) \
            or issubclass(wrapped, wrapper) or issubclass(wrapper, wrapped):
        return wrapper
    with _LOCK:
        made = _MADE.get((wrapper, wrapped))
        if made is None:
            made = _MADE[(wrapper, wrapped)] = passing_subclass(wrapper, wrapped)
            registered = registered_name(wrapper)
            if ">" in registered:
                package, name = registered.split(">", 1)
                register(package, name)(made)
                register(package, name)(wrapper)  # the name still finds `wrapper`
    return made


def passing_subclass(wrapper: type, wrapped: type) -> type:
    """A subclass of `wrapper` with `wrapped` among its bases (`isinstance(opt, wrapped)`
    holds), which behaves exactly as `wrapper`: an attribute `wrapped` adds to the Keras
    Optimizer both derive from is read from the wrapped optimizer (`inner_optimizer`), one
    it overrides is Keras' Optimizer's. It has `wrapper`'s name, module and docstring, and
    `_hvdx_wrapper` / `_hvdx_wrapped_class` name the two. `subclass_for` caches and registers it."""
    shared = [k for k in wrapper.__mro__ if k in wrapped.__mro__]  # Keras' Optimizer and its bases
    own = [k for k in wrapper.__mro__ if k not in shared]
    namespace = {"__module__": wrapper.__module__, "__qualname__": wrapper.__qualname__, "__doc__": wrapper.__doc__,
                 "_hvdx_wrapper": wrapper, "_hvdx_wrapped_class": wrapped}
    for klass in wrapped.__mro__:  # the wrapped class's own attributes, most derived first
        if klass in shared:
            continue
        for name, value in vars(klass).items():
            if name in namespace or name in _STRUCTURAL or not hasattr(value, "__get__") \
                    or any(name in vars(k) for k in own):  # plain data, or the wrapper's own: as they are
                continue
            base = next((k for k in shared if name in vars(k)), None)
            namespace[name] = vars(base)[name] if base is not None else _FromWrapped(name)
    return type(wrapper.__name__, (wrapper, wrapped), namespace)
