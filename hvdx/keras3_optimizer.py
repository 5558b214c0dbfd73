"""hvdx.DistributedOptimizer around a Keras 3 optimizer: the Keras 3 adapter.

    import hvdx, keras
    hvdx.init()
    opt = hvdx.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), communication="hitopk")
    model.compile(optimizer=opt, loss=...)    # a Keras 3 model (`keras.Sequential`, ...)

`hvdx.DistributedOptimizer` (hvdx/optimizer.py, the Keras 2 adapter) hands a Keras 3
optimizer (`hvdx.wrapper_core.is_keras3_optimizer`: `keras.optimizers.*` of the Keras 3
package) to `DistributedOptimizer` here; a tf_keras one stays on the Keras 2 path. Both run in
one process (`import keras` is Keras 3 whatever tf.keras is; tf_keras beside it).
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
- The traits the strategies' defaults read: `hvdx.comm.traits.traits_of`, which describes
  either Keras' SGD and Adam family from their classes.
- Saving: registered as a Keras 3 serializable ("hvdx>DistributedOptimizer"); `get_config`
  pins the strategy as on the Keras 2 path; a `.keras` archive keeps the wrapped optimizer's
  variables (under `inner_optimizer`: a wrapped LossScaleOptimizer's dynamic scale too) and
  this rank's residuals (the wrapper's own variables); `tf.train.Checkpoint` tracks both too.

- Mixed precision (Keras 3's LossScaleOptimizer, "LSO") goes INSIDE the wrapper:
  `hvdx.DistributedOptimizer(keras.mixed_precision.LossScaleOptimizer(opt), ...)`, or a plain
  optimizer given while the global policy is mixed_float16, which the wrapper then puts in an
  LSO itself (what Keras' `compile` would have done for a mixed_float16 model). The wrapper is
  then an instance of LossScaleOptimizer (so `compile` does not wrap it again); `scale_loss`,
  `dynamic_scale`, `initial_scale` are the LSO's, the hyper-parameters (`momentum`, ...), the
  traits the strategies' defaults read and momentum correction are the optimizer's inside it.
  Each step the ranks first agree whether every rank's (scaled) gradients are finite: one
  scalar allreduce (Min) of a flag. Finite everywhere: the gradients are aggregated (the
  strategies' residuals are kept in the scaled units and rescaled when the scale changes),
  then the LSO unscales and applies them, every rank the same aggregate. Not finite on any
  rank: the aggregation is skipped on every rank (residuals and velocities untouched, no
  top-k of a NaN on one rank), the LSO is handed non-finite gradients, so it halves its scale
  and skips the step on every rank alike, and `nonfinite_steps` counts it (saved with the
  residuals). The aggregation's collectives run inside a tf.cond on that agreed flag: every
  rank takes the same branch. With backward_passes_per_step the flag is taken on the
  window's sums, at the pass that aggregates them. A sparse gradient (tf.IndexedSlices) is
  aggregated as always but handed on dense (the tf.cond's other branch cannot match its rows).
- An LSO OUTSIDE the wrapper (`LossScaleOptimizer(hvdx.DistributedOptimizer(opt))`, or a
  wrapper made under float32 then compiled into a mixed_float16 model, around which Keras'
  `compile` puts one) is refused with ValueError when it builds the wrapper (fit's first
  step), naming both fixes. It cannot be made correct without changing Keras: its
  finiteness check reads each rank's own gradients before calling the wrapper, so a rank
  whose gradients overflowed would skip the step and its collectives while the others wait
  in theirs (a hang). Keras gives the wrapped optimizer no sign of the LSO around it (its
  `loss_scale_factor = None` is short-circuited by Keras' `__setattr__`), so the wrapper
  looks for it on the Python stack of its `build` and `apply` (an LSO whose `inner_optimizer`
  is the wrapper); rather than a policy check, which would refuse `compile(...,
  auto_scale_loss=False)`, where no LSO is made.

- hvdx's Keras 3 LARS / LAMB (`hvdx.optimizers.keras3`): as on the Keras 2 path, they are
  handed each aggregation's record (`AggregationObserver`, `wrapper_core.aggregate_and_observe`)
  and, with the local trust ratio on, LARS' trust ratio goes before the strategy and its step
  applies the aggregate inside `trust_applied()`. An optimizer that declares its traits
  (`hvdx_traits`) with a momentum has its momentum set to 0 in the step under momentum
  correction, as Keras 3's SGD (a Python number its step reads when traced).

XLA cannot compile the step (Horovod's collectives): a step compiled with it (Keras 3's
`jit_compile="auto"` where a GPU is visible) is refused, saying to compile with
`jit_compile=False`.
"""
from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any, Dict, Iterator, List, Optional, Union

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from hvdx import comm
from hvdx.accumulation import aggregate_passes
from hvdx.aggregator import AUTO_BUCKET_BYTES, GradientAggregator
from hvdx.comm.traits import plain_number, traits_of
from hvdx import wrapper_core
from hvdx.wrapper_core import (WrapperCore, aggregate_and_observe, arguments_from_config, check_name,
                               is_keras3_optimizer, residual_state, restore_residuals)

__all__ = ["DistributedOptimizer", "subclass_for"]

if int(keras.__version__.split(".")[0]) < 3:
    raise ImportError(f"hvdx.keras3_optimizer is the Keras 3 adapter; the keras package here is {keras.__version__} "
                      "(TensorFlow 2.15's Keras 2): wrap tf.keras optimizers with hvdx.DistributedOptimizer")

_EXAMPLE = "keras.optimizers.SGD(lr, momentum=0.9)"



def subclass_for(wrapper: type, wrapped: type) -> type:
    """The class of a `wrapper` instance that wraps a `wrapped` instance: `wrapper` itself
    unless `wrapped` is a Keras 3 optimizer class (and no wrapper), else a subclass of both,
    one per pair, registered under `wrapper`'s Keras 3 name so that it saves as `wrapper`
    (`hvdx.wrapper_core.subclass_for`)."""
    return wrapper_core.subclass_for(wrapper, wrapped, keras.optimizers.Optimizer, keras.saving.get_registered_name,
                                     keras.saving.register_keras_serializable)


def _dense_if_sparse(gradient):
    """`gradient` as a dense tensor (an aggregated tf.IndexedSlices: rows from every rank, whose
    count a tf.cond's other branch cannot match)."""
    return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient


def _refuse_xla() -> None:
    """Raises ValueError inside an XLA-compiled function: Horovod's and hvdx's collectives
    are not XLA operations. Keras 3 compiles `fit`'s step with XLA by default where a GPU is
    visible (`jit_compile="auto"`); Keras 2 never did."""
    from tensorflow.python.ops import control_flow_util  # TensorFlow's own test of an XLA context

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError("hvdx.DistributedOptimizer's step runs Horovod's collectives, which XLA cannot compile: "
                         "compile the Keras 3 model with model.compile(..., jit_compile=False) (Keras 3 turns "
                         "XLA on by default where a GPU is visible)")


_LOSS_SCALER = keras.optimizers.LossScaleOptimizer
_FIX = ("wrap the loss scaler inside instead: hvdx.DistributedOptimizer(keras.mixed_precision.LossScaleOptimizer("
        "optimizer), ...), or set the mixed_float16 policy (keras.mixed_precision.set_global_policy) before making "
        "the wrapper, which then puts the LossScaleOptimizer inside itself")


def _loss_scaled_here(optimizer: Any) -> bool:
    """Whether the wrapper puts a LossScaleOptimizer around `optimizer` itself: Keras 3's
    global dtype policy is mixed_float16 (as `compile` would, for a model of that policy) and
    `optimizer` is not one already."""
    return keras.mixed_precision.global_policy().name == "mixed_float16" and not isinstance(optimizer, _LOSS_SCALER)


def _refuse_outer_loss_scaler(wrapper: Any) -> None:
    """Raises ValueError where a Keras 3 LossScaleOptimizer around `wrapper` calls it (builds
    it, or applies through it): `LossScaleOptimizer(hvdx.DistributedOptimizer(opt))`, or
    `compile` of a mixed_float16 model given a wrapper made under another policy. Its
    finiteness check reads each rank's own gradients before the wrapper aggregates them: a
    rank whose gradients are not finite would skip the step, and its collectives, while the
    others wait in theirs. Found on the Python stack (the loss scaler whose `inner_optimizer`
    is `wrapper`): Keras gives the wrapped optimizer no other sign of it."""
    frame = sys._getframe(1)
    for _ in range(60):  # the loss scaler's build or apply, its tf.cond and Keras' layers between
        if frame is None:
            return
        outer = frame.f_locals.get("self")
        if outer is not wrapper and isinstance(outer, _LOSS_SCALER) and \
                outer.__dict__.get("inner_optimizer") is wrapper:
            raise ValueError(
                "a Keras 3 LossScaleOptimizer around hvdx.DistributedOptimizer checks each rank's own gradients "
                "for finiteness before they are aggregated, so ranks could skip different steps (and hang in "
                f"their collectives); {_FIX}")
        frame = frame.f_back


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

    Mixed precision: a Keras 3 `LossScaleOptimizer` is wrapped like any optimizer (made so
    here where the global policy is mixed_float16); the wrapper is then an instance of
    LossScaleOptimizer, `opt.dynamic_scale` and `opt.scale_loss` are the loss scaler's, the
    hyper-parameters read through to the optimizer inside it, and `opt.nonfinite_steps`
    counts the steps skipped because some rank's gradients were not finite (module docstring).

    Raises:
      ValueError: an optimizer that is not a Keras 3 one, an hvdx wrapper already, or any
        argument the Keras 2 path refuses, naming the fix; a LossScaleOptimizer around the
        wrapper, when it builds the wrapper or applies through it (`fit`'s first step).
    """

    averages_gradients_every_step = True  # hvdx.wrapped.SYNCHRONOUS_MARKER: asynchronous methods refuse it

    def __new__(cls, optimizer=None, *args, **kwargs):
        # under mixed_float16 the wrapper puts a LossScaleOptimizer inside (__init__): its class
        made = subclass_for(cls, _LOSS_SCALER if is_keras3_optimizer(optimizer) and _loss_scaled_here(optimizer)
                            else type(optimizer))
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
        if isinstance(optimizer, _LOSS_SCALER) and \
                getattr(type(optimizer.inner_optimizer), "averages_gradients_every_step", False) is True:
            raise ValueError(f"the LossScaleOptimizer wraps an hvdx.DistributedOptimizer already; {_FIX}")
        if issubclass(type(self), _LOSS_SCALER) and not isinstance(optimizer, _LOSS_SCALER):
            # the mixed_float16 policy (__new__ chose the class): what Keras' compile would do
            optimizer = _LOSS_SCALER(optimizer, name="loss_scale_optimizer")
        # Keras' Optimizer's, not the next class's (the wrapped one's, in a class from `subclass_for`)
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name or f"Distributed{type(optimizer).__name__}")
        self.inner_optimizer = optimizer
        stepping = self._stepping
        if isinstance(optimizer, _LOSS_SCALER):  # residuals rescaled when the scale changes
            strategy_options["loss_scale"] = lambda: optimizer.dynamic_scale
            with tf.init_scope():
                self._nonfinite_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvdx_nonfinite_steps")
        self._core = WrapperCore(
            stepping, traits_of(stepping), example=_EXAMPLE, device_dense=device_dense,
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
    def _stepping(self):
        """The optimizer that updates the variables: the wrapped one, or the one inside a
        wrapped LossScaleOptimizer (its traits, momentum and hyper-parameters are the step's)."""
        inner = self.__dict__["inner_optimizer"]
        return inner.inner_optimizer if isinstance(inner, _LOSS_SCALER) else inner

    @property
    def _loss_scaler(self):
        """The wrapped LossScaleOptimizer, or None."""
        inner = self.__dict__.get("inner_optimizer")
        return inner if isinstance(inner, _LOSS_SCALER) else None

    @property
    def nonfinite_steps(self) -> Optional[tf.Variable]:
        """With a LossScaleOptimizer inside: the steps on which some rank's gradients were not
        finite (int64; the same on every rank), whose aggregation was skipped; else None."""
        return self.__dict__.get("_nonfinite_steps")

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
        self._core.switch(communication, traits_of(self._stepping))
        self._check_momentum_correction()

    @property
    def local_trust_ratio(self) -> bool:
        """Whether a wrapped LARS' trust ratio is applied to each rank's gradient before the
        strategy (on only while the strategy is a sparse one)."""
        return self._core.local_trust

    def register_local_var(self, var) -> None:
        """Horovod's: the gradient of `var` is not aggregated (divided by the number of ranks
        when scale_local_gradients)."""
        self._core.aggregator.register_local_var(var)

    def _momentum_zeroable(self) -> bool:
        """Whether the wrapper can apply the wrapped optimizer's step without its momentum:
        Keras 3's SGD, whose step reads `self.momentum`, a Python number, when traced; or an
        optimizer whose declared traits (`hvdx_traits`) have a momentum, which promise the same
        (hvdx's Keras 3 LARS)."""
        stepping = self._stepping
        if getattr(type(stepping), "hvdx_traits", None) is not None:
            return traits_of(stepping).momentum is not None
        return isinstance(stepping, keras.optimizers.SGD) and plain_number(stepping.momentum) is not None

    def _check_momentum_correction(self) -> None:
        """A strategy with momentum correction needs a wrapped optimizer whose momentum the
        wrapper can set to 0 in the step (else momentum would be applied twice).

        Raises:
          ValueError: naming the fix.
        """
        number = plain_number(getattr(self._stepping, "momentum", 0.0) or 0.0)
        if self._core.momentum_corrected and (number is None or number) and not self._momentum_zeroable():
            raise ValueError(f"{self._core.aggregator.strategy!r} applies momentum correction, but the wrapper cannot "
                             f"set the momentum of {type(self._stepping).__name__} to 0 in its step (it would "
                             f"be applied twice): use {_EXAMPLE}, an optimizer without momentum, or "
                             "momentum_correction=False")

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: the wrapped optimizer's public hyper-parameters
        # (momentum, beta_1, ...) read through the wrapper, as Horovod's callbacks do; never a
        # private attribute, which Keras' own code probes on the wrapper itself. A wrapped
        # LossScaleOptimizer's own (dynamic_scale, initial_scale, ...), else its optimizer's.
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(inner, name)
        except AttributeError:
            if not isinstance(inner, _LOSS_SCALER):
                raise
            return getattr(inner.inner_optimizer, name)

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
        _refuse_outer_loss_scaler(self)
        if not self.built:
            self.build(trainable_variables)
        aggregated = self._aggregate(grads, trainable_variables)
        applies = self._core.applies_now()
        # with the local trust ratio, the wrapped LARS applies the aggregate as local_trusted's (ratio 1, no decay)
        trusted = self._stepping.trust_applied(True) if self._core.local_trust else contextlib.nullcontext()
        with self._momentum_as_corrected(), trusted:
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

    def _aggregate(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        """The step's aggregation (the hook a subclass may narrow, as on the Keras 2 path):
        through the local accumulation, and with a LossScaleOptimizer inside only where every
        rank's gradients are finite (`_aggregate_if_finite`)."""
        if self._loss_scaler is None:
            return self._core.aggregate(grads, variables)
        return aggregate_passes(self._core.accumulator, self._aggregate_if_finite, grads, variables)

    def _aggregate_if_finite(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        """With a LossScaleOptimizer inside: the ranks first agree whether every rank's `grads`
        are finite (one scalar allreduce, Min), then all aggregate them, or all skip the
        aggregation (the strategies' residuals and velocities untouched, no gradient selected
        on one rank only) and hand the loss scaler non-finite gradients, so that it halves its
        scale and skips the step on every rank alike; `nonfinite_steps` counts those. The
        collectives of the aggregation run inside the tf.cond: every rank takes the same branch."""
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return list(grads)
        values = [grads[i].values if isinstance(grads[i], tf.IndexedSlices) else grads[i] for i in present]
        mine = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])
        aggregator = self._core.aggregator
        everyone = hvd.allreduce(tf.cast(mine, tf.float32), op=hvd.Min, process_set=aggregator.process_set,
                                 name="hvdx_keras3_all_finite")

        def finite():
            out = aggregate_and_observe(self._core.optimizer, aggregator, grads, variables, self._core.local_trust,
                                        self._core.trust_norms)
            return [_dense_if_sparse(out[i]) for i in present]

        def not_finite():
            with tf.control_dependencies([self._nonfinite_steps.assign_add(1)]):
                return [tf.fill(tf.shape(v), tf.constant(float("nan"), v.dtype))
                        if not isinstance(grads[i], tf.IndexedSlices) else
                        tf.fill(tf.cast(grads[i].dense_shape, tf.int32), tf.constant(float("nan"), v.dtype))
                        for i, v in zip(present, values)]

        results = tf.cond(everyone > 0.5, finite, not_finite)
        out: List[Any] = [None] * len(grads)
        for i, r in zip(present, results if isinstance(results, (list, tuple)) else [results]):
            out[i] = r
        return out

    @contextlib.contextmanager
    def _momentum_as_corrected(self) -> Iterator[None]:
        """With momentum correction on, the wrapped SGD's momentum reads 0 inside (its step is
        traced, or run eagerly, there: the strategy applied the momentum before aggregating)."""
        if not (self._core.momentum_corrected and self._momentum_zeroable()):
            yield
            return
        inner = self._stepping
        number = inner.momentum
        object.__setattr__(inner, "momentum", 0.0)
        try:
            yield
        finally:
            object.__setattr__(inner, "momentum", number)

    def scale_loss(self, loss):
        """The wrapped optimizer's: a LossScaleOptimizer's dynamic scale, or its
        `loss_scale_factor` (which its `apply` divides by)."""
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- state -------------------------------------------------------------------------
    def build(self, var_list):
        """Builds the wrapped optimizer's state, and the residuals once hvdx.init() has run
        (so that a `.keras` archive or checkpoint restores into them)."""
        _refuse_outer_loss_scaler(self)
        var_list = list(var_list)
        if not self.inner_optimizer.built:  # a LossScaleOptimizer's build makes new variables every time
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
        if self.nonfinite_steps is not None:
            store["nonfinite_steps"] = self.nonfinite_steps.numpy()

    def load_own_variables(self, store) -> None:
        """Restores what `save_own_variables` saved (residuals not created yet get their values
        when they are)."""
        keys = list(store.keys())
        restore_residuals(self._core.aggregator, keys, lambda key: store[key][...])
        if self.nonfinite_steps is not None and "nonfinite_steps" in keys:
            self.nonfinite_steps.assign(store["nonfinite_steps"][...])

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
        """The wrapped optimizer's momentum (inside a LossScaleOptimizer: its optimizer's;
        AttributeError where it has none). A new value set here reaches its step at the next
        trace, as it does on the wrapped optimizer."""
        return self._stepping.momentum

    @momentum.setter
    def momentum(self, value) -> None:
        self._stepping.momentum = value

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
