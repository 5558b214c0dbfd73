"""hvdx.DistributedOptimizer around a Keras 3 optimizer: the Keras 3 adapter.

    import hvdx, keras
    hvdx.init()
    opt = hvdx.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), communication="hitopk")
    model.compile(optimizer=opt, loss=...)    # a Keras 3 model (`keras.Sequential`, ...)

`hvdx.DistributedOptimizer` (hvdx/optimizer.py, the Keras 2 adapter) hands a Keras 3
optimizer (`hvdx.wrapper_core.is_keras3_optimizer`: `keras.optimizers.*` of the Keras 3
package) to `DistributedOptimizer` here; a tf_keras one stays on the Keras 2 path. Both run in
one process on the default stack (tf.keras is tf_keras there, `import keras` is Keras 3).
What is Keras-neutral (the arguments, the aggregator, the local accumulation, the config,
the residuals as arrays) is `hvdx.wrapper_core.WrapperCore`; this module holds what is Keras
3's:

- The step. Keras 3 optimizers have no aggregation hook: `apply(grads, trainable_variables)`
  (which `apply_gradients` and `Model.fit`'s train step call) aggregates the gradients over
  the ranks, then has the wrapped optimizer apply them (every N-th pass with
  backward_passes_per_step=N; the passes between only count its iterations).
- Its class: an instance of the wrapped optimizer's class (`isinstance(opt,
  keras.optimizers.SGD)`), as on the Keras 2 path (`subclass_for`, on Keras 3's Optimizer).
- Momentum correction (DGC): the strategy accumulates the velocity, so the wrapped SGD
  applies the aggregate with momentum 0, which its step reads, as a Python number, while the
  wrapper traces it. Only Keras 3's SGD can be so corrected; another optimizer with a
  momentum is refused with momentum correction.
- The traits the strategies' defaults read (`keras3_traits`): Keras 3's SGD and Adam family
  described from their classes, as `hvdx.comm.traits.traits_of` does for tf.keras's.
- Saving: registered as a Keras 3 serializable ("hvdx>DistributedOptimizer"); `get_config`
  pins the strategy as on the Keras 2 path; a `.keras` archive keeps the wrapped optimizer's
  variables (under `inner_optimizer`) and this rank's residuals (the wrapper's own
  variables); `tf.train.Checkpoint` tracks both too.

Not yet (docs/keras3.md): mixed precision (a Keras 3 LossScaleOptimizer inside or around
the wrapper), hvdx's LARS/LAMB as Keras 3 optimizers, Horovod's Keras callbacks and
`hvdx.load_model` over Keras 3 models. XLA cannot compile the step (Horovod's collectives):
a step compiled with it (Keras 3's `jit_compile="auto"` where a GPU is visible) is refused,
saying to compile with `jit_compile=False`.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from hvdx import comm
from hvdx.aggregator import AUTO_BUCKET_BYTES, GradientAggregator
from hvdx.comm.traits import OptimizerTraits, plain_number, traits_of
from hvdx import wrapper_core
from hvdx.wrapper_core import (WrapperCore, arguments_from_config, check_name, is_keras3_optimizer, residual_state,
                               restore_residuals)

__all__ = ["DistributedOptimizer", "keras3_traits", "subclass_for"]

if int(keras.__version__.split(".")[0]) < 3:
    raise ImportError(f"hvdx.keras3_optimizer is the Keras 3 adapter; the keras package here is {keras.__version__} "
                      "(TensorFlow 2.15's Keras 2): wrap tf.keras optimizers with hvdx.DistributedOptimizer")

#: Keras 3's optimizers with Adam's per-coordinate moments (subclasses included).
_ADAM_FAMILY: Tuple[type, ...] = tuple(cls for cls in (getattr(keras.optimizers, name, None) for name in (
    "Adam", "AdamW", "Adamax", "Nadam")) if isinstance(cls, type))
_EXAMPLE = "keras.optimizers.SGD(lr, momentum=0.9)"



def keras3_traits(optimizer: Any) -> OptimizerTraits:
    """The `OptimizerTraits` of a Keras 3 optimizer: its own declaration (`hvdx_traits`, read by
    `traits_of`), else Keras 3's SGD (that class itself: a subclass may change the update) with
    its momentum and Nesterov flag, the Adam family as adaptive, else none."""
    if getattr(type(optimizer), "hvdx_traits", None) is not None:
        return traits_of(optimizer)
    name = type(optimizer).__name__
    if type(optimizer) is keras.optimizers.SGD:
        return OptimizerTraits(name=name, momentum=plain_number(optimizer.momentum),
                               nesterov=bool(optimizer.nesterov))
    if isinstance(optimizer, _ADAM_FAMILY):
        return OptimizerTraits(name=name, adaptive=True)
    return OptimizerTraits(name=name)


def subclass_for(wrapper: type, wrapped: type) -> type:
    """The class of a `wrapper` instance that wraps a `wrapped` instance: `wrapper` itself
    unless `wrapped` is a Keras 3 optimizer class (and no wrapper), else a subclass of both,
    one per pair, registered under `wrapper`'s Keras 3 name so that it saves as `wrapper`
    (`hvdx.wrapper_core.subclass_for`)."""
    return wrapper_core.subclass_for(wrapper, wrapped, keras.optimizers.Optimizer, keras.saving.get_registered_name,
                                     keras.saving.register_keras_serializable)


def _refuse_xla() -> None:
    """Raises ValueError inside an XLA-compiled function: Horovod's and hvdx's collectives
    are not XLA operations. Keras 3 compiles `fit`'s step with XLA by default where a GPU is
    visible (`jit_compile="auto"`); Keras 2 never did."""
    from tensorflow.python.ops import control_flow_util  # TensorFlow's own test of an XLA context

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError("hvdx.DistributedOptimizer's step runs Horovod's collectives, which XLA cannot compile: "
                         "compile the Keras 3 model with model.compile(..., jit_compile=False) (Keras 3 turns "
                         "XLA on by default where a GPU is visible)")


def _refuse_mixed_precision() -> None:
    """Raises ValueError under Keras 3's mixed_float16 policy: `compile` then wraps the
    optimizer in a LossScaleOptimizer, which checks each rank's own gradients for finiteness
    before the wrapper aggregates them, so one rank could skip the step (and its collectives)
    while the others wait in theirs."""
    if keras.mixed_precision.global_policy().name == "mixed_float16":
        raise ValueError("hvdx.DistributedOptimizer does not support Keras 3's mixed_float16 policy yet: its "
                         "LossScaleOptimizer would decide on each rank's own gradients before they are "
                         "aggregated, and ranks could skip different steps. Train in float32 (or "
                         "mixed_bfloat16, which needs no loss scaling), or use tf.keras (Keras 2) with "
                         "tf.keras.mixed_precision (docs/keras3.md)")


@keras.saving.register_keras_serializable(package="hvdx")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer so that gradients are aggregated over all ranks before the
    wrapped optimizer applies them; an instance of the wrapped optimizer's class. Made by
    `hvdx.DistributedOptimizer(keras_optimizer, ...)`, which takes the same arguments with
    the same meaning on both Keras (Horovod's, in Horovod's order, then hvdx's keyword-only
    ones: communication=, bucket_bytes=, momentum_correction=, local_trust_ratio=,
    trust_norms=, the strategy's options; see hvdx.optimizer.DistributedOptimizer).

    The wrapped optimizer keeps its type and configuration (`.inner_optimizer`); its
    hyper-parameters read through the wrapper (`opt.learning_rate`, `opt.momentum`,
    `opt.beta_1`), `opt.iterations` and `opt.variables` are its own.

    Raises:
      ValueError: an optimizer that is not a Keras 3 one, an hvdx wrapper already, a Keras 3
        LossScaleOptimizer (not yet), or any argument the Keras 2 path refuses, naming the fix.
    """

    averages_gradients_every_step = True  # hvdx.wrapped.SYNCHRONOUS_MARKER: asynchronous methods refuse it

    def __new__(cls, optimizer=None, *args, **kwargs):
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
        if not is_keras3_optimizer(optimizer):
            raise ValueError(f"hvdx.keras3_optimizer.DistributedOptimizer wraps a Keras 3 optimizer "
                             f"(keras.optimizers.*), got {type(optimizer).__name__}: call "
                             "hvdx.DistributedOptimizer(optimizer), which takes either Keras' optimizers")
        if getattr(type(optimizer), "averages_gradients_every_step", False) is True:
            raise ValueError("the optimizer is already an hvdx.DistributedOptimizer")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError("hvdx.DistributedOptimizer does not take Keras 3's LossScaleOptimizer yet (mixed "
                             "precision under Keras 3, docs/keras3.md): wrap the plain optimizer and train in "
                             "float32, or use tf.keras (Keras 2) with tf.keras.mixed_precision")
        # Keras' Optimizer's, not the next class's (the wrapped one's, in a class from `subclass_for`)
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name or f"Distributed{type(optimizer).__name__}")
        self.inner_optimizer = optimizer
        self._core = WrapperCore(
            optimizer, keras3_traits(optimizer), example=_EXAMPLE, device_dense=device_dense,
            device_sparse=device_sparse, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients, communication=communication,
            bucket_bytes=bucket_bytes, momentum_correction=momentum_correction,
            local_trust_ratio=local_trust_ratio, trust_norms=trust_norms, **strategy_options)
        # Tracked (tf.Modules on a Keras 3 optimizer): tf.train.Checkpoint carries the residuals
        # and the accumulation's sums with the wrapper.
        self._aggregator = self._core.aggregator
        self._agg_helper = self._core.accumulator  # Horovod's name (its tests read `_agg_helper.counter`)
        self._check_momentum_correction()

    # -- what the wrapper is -----------------------------------------------------------
    @property
    def aggregator(self) -> GradientAggregator:
        return self._core.aggregator

    @property
    def communication(self) -> comm.Strategy:
        return self._core.aggregator.strategy

    def set_communication(self, communication: Union[str, comm.Strategy]) -> None:
        """Switches the strategy; takes effect when the step function is traced again (as
        `hvdx.optimizer.DistributedOptimizer.set_communication`).

        Raises:
          ValueError: as the constructor, for the new strategy (momentum correction with an
            optimizer whose momentum the wrapper cannot set to 0).
        """
        self._core.switch(communication, keras3_traits(self.inner_optimizer))
        self._check_momentum_correction()

    @property
    def local_trust_ratio(self) -> bool:
        """Whether a wrapped LARS' trust ratio is applied to each rank's gradient before the
        strategy (no Keras 3 optimizer has one yet: False)."""
        return self._core.local_trust

    def register_local_var(self, var) -> None:
        """Horovod's: the gradient of `var` is not aggregated (divided by the number of ranks
        when scale_local_gradients)."""
        self._core.aggregator.register_local_var(var)

    def _momentum_zeroable(self) -> bool:
        """Whether the wrapper can apply the wrapped optimizer's step without its momentum:
        Keras 3's SGD, whose step reads `self.momentum`, a Python number, when traced."""
        return isinstance(self.inner_optimizer, keras.optimizers.SGD) and \
            plain_number(self.inner_optimizer.momentum) is not None

    def _check_momentum_correction(self) -> None:
        """A strategy with momentum correction needs a wrapped optimizer whose momentum the
        wrapper can set to 0 in the step (else momentum would be applied twice).

        Raises:
          ValueError: naming the fix.
        """
        number = plain_number(getattr(self.inner_optimizer, "momentum", 0.0) or 0.0)
        if self._core.momentum_corrected and (number is None or number) and not self._momentum_zeroable():
            raise ValueError(f"{self._core.aggregator.strategy!r} applies momentum correction, but the wrapper cannot "
                             f"set the momentum of {type(self.inner_optimizer).__name__} to 0 in its step (it would "
                             f"be applied twice): use {_EXAMPLE}, an optimizer without momentum, or "
                             "momentum_correction=False")

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: the wrapped optimizer's public hyper-parameters
        # (momentum, beta_1, ...) read through the wrapper, as Horovod's callbacks do; never a
        # private attribute, which Keras' own code probes on the wrapper itself.
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(inner, name)

    # -- the step ----------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars):
        """Keras' `apply_gradients`: `apply`; returns the wrapped optimizer's iterations."""
        grads_and_vars = list(grads_and_vars)
        if grads_and_vars:
            grads, variables = zip(*grads_and_vars)
            self.apply(list(grads), list(variables))
        return self.iterations

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """Aggregates `grads` over the ranks, then has the wrapped optimizer apply them to
        `trainable_variables` (None: the variables it was built with). Builds both on the
        first call, as Keras' `apply` does.

        Raises:
          ValueError: no variables given to an unbuilt wrapper, or a count that does not match.
        """
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError("When passing `grads` without `variables`, the optimizer must already be built on a "
                                 "list of variables: call `optimizer.build(trainable_variables)` first")
            trainable_variables = list(self._trainable_variables)
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(f"{len(grads)} gradients for {len(trainable_variables)} variables")
        _refuse_xla()
        _refuse_mixed_precision()
        if not self.built:
            self.build(trainable_variables)
        aggregated = self._core.aggregate(grads, trainable_variables)
        applies = self._core.applies_now()
        with self._momentum_as_corrected():
            if applies is None:
                self.inner_optimizer.apply(aggregated, trainable_variables)
                return

            def step():
                self.inner_optimizer.apply(aggregated, trainable_variables)
                return tf.constant(True)

            def skip():  # a pass that only accumulated: counted, as Horovod counts it
                self.inner_optimizer.iterations.assign_add(1)
                return tf.constant(False)

            tf.cond(applies, step, skip)

    @contextlib.contextmanager
    def _momentum_as_corrected(self) -> Iterator[None]:
        """With momentum correction on, the wrapped SGD's momentum reads 0 inside (its step is
        traced, or run eagerly, there: the strategy applied the momentum before aggregating)."""
        if not (self._core.momentum_corrected and self._momentum_zeroable()):
            yield
            return
        inner = self.inner_optimizer
        number = inner.momentum
        object.__setattr__(inner, "momentum", 0.0)
        try:
            yield
        finally:
            object.__setattr__(inner, "momentum", number)

    def scale_loss(self, loss):
        """The wrapped optimizer's (its `loss_scale_factor`, which its `apply` divides by)."""
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- state -------------------------------------------------------------------------
    def build(self, var_list):
        """Builds the wrapped optimizer's state, and the residuals once hvdx.init() has run
        (so that a `.keras` archive or checkpoint restores into them)."""
        var_list = list(var_list)
        self.inner_optimizer.build(var_list)
        from hvdx.topology import initialized

        if initialized():
            with tf.init_scope():
                self._core.aggregator.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)  # Keras' own, not the wrapped class's (no slots here)

    @property
    def variables(self) -> List[Any]:
        """The wrapped optimizer's variables: what Horovod's callbacks broadcast. The residuals
        are per rank (saved, never broadcast): `.aggregator.residuals`."""
        return list(self.inner_optimizer.variables)

    def save_own_variables(self, store) -> None:
        """Keras 3's `.keras` format: this rank's residuals with their owners, scales and
        counters (Keras saves the wrapped optimizer's variables itself, under inner_optimizer)."""
        for key, value in residual_state(self._core.aggregator).items():
            store[key] = value

    def load_own_variables(self, store) -> None:
        """Restores what `save_own_variables` saved (residuals not created yet get their values
        when they are)."""
        restore_residuals(self._core.aggregator, list(store.keys()), lambda key: store[key][...])

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    @property
    def momentum(self):
        """The wrapped optimizer's momentum (AttributeError where it has none). A new value set
        here reaches its step at the next trace, as it does on the wrapped optimizer."""
        return self.inner_optimizer.momentum

    @momentum.setter
    def momentum(self, value) -> None:
        self.inner_optimizer.momentum = value

    def get_config(self) -> Dict[str, Any]:
        """The wrapped optimizer's config, the name, Horovod's and hvdx's options, the strategy
        pinned (`WrapperCore.config`).

        Raises:
          ValueError: a custom compression, or an unregistered strategy instance.
        """
        return {"optimizer": keras.saving.serialize_keras_object(self.inner_optimizer), "name": self.name,
                **self._core.config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        optimizer = keras.saving.deserialize_keras_object(copy.deepcopy(config["optimizer"]),
                                                          custom_objects=custom_objects)
        return cls(optimizer, **arguments_from_config(config))
