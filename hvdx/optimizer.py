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

This is the Keras 2 (tf.keras, tf_keras) adapter: `DistributedOptimizer(optimizer)` with a
Keras 3 optimizer (`import keras`, `hvdx.wrapper_core.is_keras3_optimizer`) returns the Keras
3 adapter's wrapper instead (`hvdx/keras3_optimizer.py`); what both share is
`hvdx/wrapper_core.py`.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
from typing import Any, List, Optional, Sequence, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import comm
from hvdx.aggregator import AUTO_BUCKET_BYTES, GradientAggregator
from hvdx.comm import sparse
from hvdx.comm.traits import traits_of
from hvdx.wrapped import Momentum, check_not_horovods, subclass_for
from hvdx.wrapper_core import (WrapperCore, arguments_from_config, check_name, is_keras3_optimizer,
                               is_keras3_variable, residual_state, restore_residuals)
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]

_KERAS_OPTIMIZERS = (keras2.optimizers.Optimizer, keras2.optimizers.legacy.Optimizer)
_EXAMPLE = "tf.keras.optimizers.SGD(lr, momentum=0.9)"  # an optimizer whose momentum the wrapper corrects


class _CallableList(list):
    """A list that also answers `()`, as Keras' own optimizer.variables does."""

    def __call__(self):
        return self


def _is_legacy(optimizer) -> bool:
    return isinstance(optimizer, keras2.optimizers.legacy.Optimizer)


class EitherKeras(type):
    """The metaclass of the Keras 2 wrapper classes whose constructor makes their Keras 3
    counterpart for a Keras 3 optimizer (`__new__`): `isinstance(obj, cls)` holds for the
    counterpart's instances too, so `isinstance(opt, hvdx.DistributedOptimizer)` answers the same
    under either Keras. A class names its counterpart in `_keras3_counterpart` ("module:Class",
    imported only for a Keras 3 object); the classes made per wrapped class name none."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if super().__instancecheck__(obj):
            return True
        counterpart = cls._keras3_class() if legacy_keras.is_keras3_object(obj) else None
        return counterpart is not None and isinstance(obj, counterpart)

    def _from_config_class(cls, config: dict) -> Optional[type]:
        """The Keras 3 counterpart that rebuilds `config` (a wrapper's get_config()): where its
        optimizer is not a Keras 2 one (tf_keras' new optimizers record is_legacy_optimizer,
        its legacy ones are keras.optimizers.legacy's; Keras 3's do neither) and tf.keras is
        Keras 3 (no object to follow: hvdx.legacy_keras's rule). None: this class rebuilds it."""
        inner = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else {}
        keras2_made = ("is_legacy_optimizer" in (inner.get("config") or {})
                       or str(inner.get("module", "")).endswith(".legacy"))
        return None if keras2_made or not legacy_keras.tf_keras_is_keras3() else cls._keras3_class()

    def _keras3_class(cls) -> Optional[type]:
        """The Keras 3 counterpart this class names (imported), or None."""
        where = vars(cls).get("_keras3_counterpart")
        if where is None:
            return None
        module, name = where.split(":")
        return getattr(importlib.import_module(module), name)


@keras2.utils.register_keras_serializable(package="hvdx")
class DistributedOptimizer(keras2.optimizers.Optimizer, metaclass=EitherKeras):
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
        with a momentum (not Nesterov) at density <= 0.1, a 200-step density warm-up from dense
        for the Adam family (100 steps from 25 % for LAMB), LARS' local trust ratio (classic momentum) at
        density <= 0.1 with momentum correction up to 0.01 (measured, docs/comm.md). A
        strategy instance gets no defaults.

    The wrapped optimizer keeps its type and configuration (`.inner_optimizer`); its
    hyper-parameters are reachable on the wrapper (`opt.momentum`), as Horovod's callbacks
    expect. A wrapped `hvdx.buckets.AggregationObserver` (LARS, LAMB) is given each
    aggregation's record before it applies the gradients.
    """

    _HAS_AGGREGATE_GRAD = True
    _keras3_counterpart = "hvdx.keras3_optimizer:DistributedOptimizer"
    averages_gradients_every_step = True  # hvdx.wrapped.SYNCHRONOUS_MARKER: asynchronous methods refuse it

    def __new__(cls, optimizer=None, *args, **kwargs):
        if is_keras3_optimizer(optimizer) and vars(cls).get("_hvdx_wrapper", cls) is DistributedOptimizer:
            # A Keras 3 optimizer takes the Keras 3 path (hvdx/keras3_optimizer.py): an instance of
            # that wrapper, built here (not an instance of this class, so Python does not __init__ it).
            from hvdx import keras3_optimizer

            return keras3_optimizer.DistributedOptimizer(optimizer, *args, **kwargs)
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
        check_name(name)
        if is_keras3_optimizer(optimizer):  # reached by a subclass of this Keras 2 wrapper
            raise ValueError(f"{type(self).__name__} is Keras 2 code and wraps a Keras 2 optimizer; got the Keras 3 "
                             f"{type(optimizer).__name__} ({type(optimizer).__module__}): wrap it with "
                             "hvdx.DistributedOptimizer (or hvdx.DASO), which takes either Keras' optimizers, or run "
                             "the script with TF_USE_LEGACY_KERAS=1 and pass "
                             f"tf.keras.optimizers.{type(optimizer).__name__}(...) with a tf.keras model")
        if not isinstance(optimizer, _KERAS_OPTIMIZERS):
            hint = ("; a tf.compat.v1.train optimizer is wrapped by hvdx.tensorflow.DistributedOptimizer"
                    if isinstance(optimizer, tf.compat.v1.train.Optimizer) else "")
            raise ValueError("hvdx.DistributedOptimizer wraps a Keras optimizer (keras.optimizers.*, "
                             "tf.keras.optimizers.*, or Keras 2's tf.keras.optimizers.legacy.*), got "
                             f"{type(optimizer).__name__}{hint}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("the optimizer is already an hvdx.DistributedOptimizer")
        check_not_horovods(optimizer, "hvdx.DistributedOptimizer")
        self._ready = False
        keras2.optimizers.Optimizer.__init__(self, name=name or f"Distributed{type(optimizer).__name__}")
        self._momentum = Momentum(optimizer)
        self._optimizer = optimizer
        self._core = WrapperCore(
            optimizer, traits_of(optimizer), example=_EXAMPLE, device_dense=device_dense,
            device_sparse=device_sparse, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients, communication=communication,
            bucket_bytes=bucket_bytes, momentum_correction=momentum_correction,
            local_trust_ratio=local_trust_ratio, trust_norms=trust_norms, **strategy_options)
        # Tracked by Keras: tf.train.Checkpoint and SavedModel carry the residuals and the accumulation's sums
        self._aggregator = self._core.aggregator
        self._agg_helper = self._core.accumulator  # Horovod's name (its tests read `_agg_helper.counter`)
        self._check_momentum_correction()
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
        self._core.switch(communication, traits_of(self._optimizer))
        self._check_momentum_correction()

    @property
    def local_trust_ratio(self) -> bool:
        """Whether the wrapped LARS' trust ratio is applied to each rank's gradient before the
        strategy (on only while the strategy is a sparse one)."""
        return self._core.local_trust

    def _check_momentum_correction(self) -> None:
        """A strategy with momentum correction needs a wrapped optimizer whose momentum the
        wrapper can set to 0 in the step (else momentum would be applied twice)."""
        try:
            inner = float(getattr(self._optimizer, "momentum", 0.0) or 0.0)
        except (TypeError, ValueError):
            inner = 1.0  # a momentum the wrapper cannot read as a number
        if self._core.momentum_corrected and not self._momentum.held and inner:
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
        return self._core.aggregate(grads, variables)

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
        _check_keras2_variables(self._optimizer, [v for _, v in grads_and_vars])
        aggregate = kwargs.pop("experimental_aggregate_gradients", True) and not skip_gradients_aggregation
        if aggregate:
            grads_and_vars = self.aggregate_gradients(grads_and_vars)
        self._just_aggregated = None
        # Momentum correction (DGC): the strategy accumulated the velocity, so the wrapped
        # optimizer applies the aggregate without a momentum of its own.
        corrected = self._core.momentum_corrected
        trusted = self._optimizer.trust_applied(True) if self._core.local_trust else contextlib.nullcontext()
        variables = [v for _, v in grads_and_vars]
        if self._agg_helper is None:
            with self._momentum.read_by_step(corrected, variables), trusted:  # the step reads the momentum variable
                return self._apply(grads_and_vars)

        def skip():
            return self.iterations.assign_add(1)

        with self._momentum.read_by_step(corrected, variables), trusted:
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
        _check_keras2_variables(self._optimizer, var_list)
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
        for key, value in residual_state(self._aggregator).items():
            store[key] = value

    def load_own_variables(self, store):
        keys = list(store.keys())
        inner = sorted((k for k in keys if k.startswith("inner.")), key=lambda k: int(k.split(".")[1]))
        if inner:
            self.set_weights([store[k][...] for k in inner])
        restore_residuals(self._aggregator, [k for k in keys if not k.startswith("inner.")], lambda k: store[k][...])

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
        """The wrapped optimizer's config, the name, Horovod's and hvdx's options, the strategy
        pinned (`hvdx.wrapper_core.WrapperCore.config`)."""
        return {"optimizer": keras2.optimizers.serialize(self._optimizer), "name": self.name, **self._core.config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds a wrapper from `get_config()`; a Keras 3 optimizer's config where tf.keras is
        Keras 3 rebuilds the Keras 3 wrapper (`EitherKeras._from_config_class`)."""
        counterpart = cls._from_config_class(config)
        if counterpart is not None:
            return counterpart.from_config(config, custom_objects=custom_objects)
        # never mutate the caller's dict (Keras' deserialize would): arguments_from_config copies
        optimizer = keras2.optimizers.deserialize(copy.deepcopy(config["optimizer"]), custom_objects=custom_objects)
        return cls(optimizer, **arguments_from_config(config))


#: Re-exported: the sparse strategies' default rules (`hvdx.comm.sparse.TopKStrategy.defaults_for`).
AUTO_MOMENTUM_CORRECTION_DENSITY = sparse.AUTO_MOMENTUM_CORRECTION_DENSITY
LARS_MOMENTUM_CORRECTION_DENSITY = sparse.LARS_MOMENTUM_CORRECTION_DENSITY
ADAM_WARMUP_STEPS = sparse.ADAM_WARMUP_STEPS


def _check_keras2_variables(optimizer, variables) -> None:
    """Raises ValueError when a tf.keras (Keras 2) optimizer is given a Keras 3 model's variables
    (`import keras` models on TensorFlow 2.16+): the mix hvdx cannot serve, named with its fix."""
    mixed = next((v for v in variables if is_keras3_variable(v)), None)
    if mixed is not None:
        raise ValueError(f"hvdx.DistributedOptimizer wraps the tf.keras (Keras 2) {type(optimizer).__name__}, but the "
                         f"variable {getattr(mixed, 'path', None) or mixed.name} is a Keras 3 one (a model built with "
                         f"`import keras`): wrap a Keras 3 optimizer instead, hvdx.DistributedOptimizer("
                         f"keras.optimizers.{type(optimizer).__name__}(...)), or build the model with tf.keras")


def PartialDistributedOptimizer(optimizer, name: Optional[str] = None, local_layers=None, **kwargs):
    """Horovod's PartialDistributedOptimizer: the variables of `local_layers` keep their
    local gradients (see `register_local_var`); everything else is aggregated."""
    opt = DistributedOptimizer(optimizer, name, **kwargs)
    for layer in local_layers or ():
        for variable in layer.trainable_weights:
            opt.register_local_var(variable)
    return opt
