"""Local SGD with an outer optimizer: each rank takes `sync_every` steps with its own plain
Keras optimizer, then the ranks' models are averaged and an outer optimizer moves a shared
anchor by the pseudo-gradient (Douillard et al., "DiLoCo: Distributed Low-Communication
Training of Language Models", 2023, arXiv 2311.08105, Algorithm 1; with an outer SGD of
learning rate 1 and no momentum it is plain periodic model averaging, Lin, Stich, Patel,
Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020, arXiv 1808.07217, Algorithm 1).

One synchronisation, on every rank (DiLoCo Algorithm 1, lines 8-12):

    delta = x_anchor - mean over ranks of x_local      (the pseudo-gradient: one fused allreduce)
    x_anchor <- outer_optimizer.apply(delta, x_anchor)  (default: `default_outer_optimizer(inner)`)
    x_local <- x_anchor                                 (every rank the same model again)

The inner optimizer's state (momentum, Adam's moments) stays each rank's own; the outer one's
is the same on every rank (it sees the same averages). Keras 2 and Keras 3 alike: the model's
variables of either (a Keras 3 variable's tf.Variable, `hvdx.variables.tf_variable`), an outer
optimizer of either (the anchor is that Keras' variables). A method in one module: it is an
`hvdx.lifecycle.TrainingMethod`, so the one Keras callback drives it,

    model.compile(tf.keras.optimizers.SGD(0.05, momentum=0.9), loss)      # the plain optimizer
    model.fit(x_shard, y_shard, epochs=10,
              callbacks=[hvdx.callbacks.TrainingMethodCallback(hvdx.localsgd.LocalSGD(sync_every=8))])

and a custom loop calls the hooks itself:

    method = hvdx.localsgd.LocalSGD(sync_every=8).start(model, opt)    # collective: rank 0's model
    for epoch in range(epochs):
        for x, y in shard:                                # every rank as many steps
            ...; opt.apply_gradients(...)                 # this rank's own step
            method.after_step()                           # every sync_every steps: the outer step
        method.end_epoch(epoch, None)                     # the epoch ends synchronised
    method.finish()                                       # collective: one model on every rank
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence

import tensorflow as tf

from hvdx.arguments import integer
from hvdx.comm.traits import traits_of
from hvdx.legacy_keras import is_keras3_object, keras_of
from hvdx.lifecycle import TrainingMethod
from hvdx.variables import build_optimizer, tf_variable

__all__ = ["LocalSGD", "default_outer_optimizer"]

SYNC_NAME = "hvdx.localsgd.sync"  # the one allreduce's name, the same on every rank and every sync


def default_outer_optimizer(inner: Any = None) -> Any:
    """The outer optimizer for an inner one, of tf.keras (Keras 3 from TensorFlow 2.16 on unless
    $TF_USE_LEGACY_KERAS=1, else Keras 2).

    Over an inner optimizer with heavy-ball momentum (SGD or LARS with momentum > 0): SGD(1.0),
    each synchronisation the ranks' average (Lin et al. Algorithm 1). DiLoCo's Nesterov outer
    step over such an inner optimizer diverged in hvdx's runs (blocking, 2x2: every seed by 300
    steps; streaming 4-bit, 3x2: 1 seed of 5; docs/streaming_diloco.md): the inner momentum
    already carries the outer gradient's direction, and the outer momentum multiplies it again.
    Otherwise (the Adam family, DiLoCo's own inner AdamW; plain SGD; an unknown or no
    optimizer): DiLoCo's (sec. 3), SGD(0.7, momentum=0.9, nesterov=True).

    Args:
      inner: the inner optimizer (each rank's own), or None.
    Returns:
      a new, unbuilt tf.keras SGD.
    """
    if _heavy_ball(inner):
        return tf.keras.optimizers.SGD(learning_rate=1.0)
    return tf.keras.optimizers.SGD(learning_rate=0.7, momentum=0.9, nesterov=True)


def _heavy_ball(optimizer: Any) -> bool:
    """Whether `optimizer` (a LossScaleOptimizer's inner one) steps with a heavy-ball momentum
    > 0 on the gradient (its traits'; a legacy SGD's momentum hyper-parameter read as a number)."""
    while getattr(optimizer, "inner_optimizer", None) is not None:  # mixed precision's loss scaler
        optimizer = optimizer.inner_optimizer
    if optimizer is None:
        return False
    traits = traits_of(optimizer)
    if traits.adaptive:
        return False
    momentum = traits.momentum
    if momentum is None:
        try:
            momentum = float(getattr(optimizer, "momentum", 0.0) or 0.0)
        except (TypeError, ValueError):
            return False
    return momentum > 0


def check_outer_optimizer(optimizer: Any) -> Any:
    """`optimizer` if it is a Keras optimizer of either Keras (Keras 2's legacy ones too).

    Raises:
        ValueError: anything else, naming what to pass.
    """
    keras = keras_of(optimizer)
    kinds = [keras.optimizers.Optimizer]
    legacy = getattr(keras.optimizers, "legacy", None)
    if legacy is not None and not is_keras3_object(optimizer):
        kinds.append(legacy.Optimizer)
    if not isinstance(optimizer, tuple(kinds)):
        raise ValueError(f"outer_optimizer must be a Keras optimizer (e.g. "
                         f"keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)), got {type(optimizer).__name__}")
    return optimizer


class LocalSGD(TrainingMethod):
    """Local SGD with an outer optimizer (module docstring).

    Args:
      sync_every: local steps between two synchronisations (DiLoCo's H; Lin et al.'s H).
      outer_optimizer: a plain Keras optimizer (of either Keras, whatever the model's) applied
        to the pseudo-gradients. None (default): `default_outer_optimizer(optimizer)` at the
        first `start()` (None before it): SGD(1.0), a plain average of the ranks' models,
        over an inner optimizer with momentum; DiLoCo's Nesterov SGD(0.7, 0.9) otherwise.
      sync_every_epoch: also synchronise at each epoch's end when local steps are pending
        (True: validation and checkpoints see one model on every rank; the window of that
        outer step is shorter). False: only every `sync_every` steps, counted across epochs.

    The lifecycle: `start(model_or_variables, optimizer)` (collective: rank 0's trainable
    variables everywhere, the anchor set to them); `after_step()` (collective every
    `sync_every` steps: every rank runs as many steps); `end_epoch()`; `finish()` (the pending
    steps synchronised: one model on every rank; idempotent); `close()`; `state()` /
    `restore()`: {"steps", "outer_steps", "sync_every", "outer_optimizer" (its Keras
    config)}. The outer optimizer's momentum is a variable per anchor variable, not in
    `state()`: a run that restores only `state()` starts it from zero; keep it with
    `tf.train.Checkpoint(outer=method.outer_optimizer)`. `reset(topology)`: no transport to
    drop; the steps since the last synchronisation are abandoned at the next `start()`,
    which takes rank 0's model again.

    Raises ValueError: `sync_every` not a positive int, an optimizer (inner or outer) that
    averages gradients itself (hvdx's or Horovod's DistributedOptimizer, DASO), no float
    trainable variables, or `start()` with other variables than an earlier one.
    RuntimeError: Horovod not initialized, `after_step()` before `start()`.
    """

    label = "LocalSGD"
    same_steps_on_every_rank = True
    needs_every_step = True

    def __init__(self, sync_every: int = 8, outer_optimizer: Any = None, *, sync_every_epoch: bool = True) -> None:
        sync_every = integer(sync_every, "sync_every", 1, expected="a positive number of local steps (an int)")
        if outer_optimizer is not None:
            self.check_optimizer(check_outer_optimizer(outer_optimizer))
        self.sync_every, self.sync_every_epoch = sync_every, bool(sync_every_epoch)
        self.outer_optimizer: Any = outer_optimizer  # None: chosen at the first start()
        self._restored_outer: Optional[Dict[str, Any]] = None  # a config restore() took before it
        self.variables: List[tf.Variable] = []  # the model's (a Keras 3 variable's tf.Variable)
        self.anchor: List[Any] = []  # variables of the outer optimizer's Keras (`_anchor_values`: their tf.Variables)
        self.steps = 0           # local steps of this run (every rank the same)
        self.outer_steps = 0     # synchronisations
        self.pending = 0         # local steps since the last synchronisation
        self._started = False
        self._sync_fn = None

    # -- the lifecycle ----------------------------------------------------------------------
    def start(self, model_or_variables: Any, optimizer: Any = None, *, steps_per_epoch: Optional[int] = None,
              epochs: Optional[int] = None) -> "LocalSGD":
        """Collective over all ranks: every rank's trainable float variables take rank 0's
        values (one broadcast per dtype, fixed names), which become the anchor. Returns self."""
        if optimizer is not None:
            self.check_optimizer(optimizer)
        hvd = _horovod()
        variables = _trainable(model_or_variables)
        if self.variables and [id(v) for v in variables] != [id(v) for v in self.variables]:
            raise ValueError("LocalSGD averages the variables of its first start(); this one passed other variables "
                             "(use one LocalSGD per model)")
        if self.outer_optimizer is None:
            self.outer_optimizer = (tf.keras.optimizers.deserialize(dict(self._restored_outer))
                                    if self._restored_outer is not None else default_outer_optimizer(optimizer))
            self._restored_outer = None
        if not self.anchor:
            self.variables = variables
            self.anchor = self._make_anchor(variables)
        for dtype in sorted({v.dtype.name for v in self.variables}):  # one broadcast per dtype
            group = [v for v in self.variables if v.dtype.name == dtype]
            flat = tf.concat([tf.reshape(v, [-1]) for v in group], 0)
            flat = hvd.broadcast(flat, root_rank=0, name=f"hvdx.localsgd.start.{dtype}")
            for v, piece in zip(group, tf.split(flat, [int(tf.size(v)) for v in group])):
                v.assign(tf.reshape(piece, v.shape))
        for a, v in zip(self._anchor_values(), self.variables):
            a.assign(v)
        self.pending = 0
        self._started = True
        return self

    def _make_anchor(self, variables: Sequence[tf.Variable]) -> List[Any]:
        """The anchor: a copy of `variables` as variables of the outer optimizer's Keras (a
        Keras 3 optimizer updates Keras 3 variables only), the optimizer built on all of them
        (Keras' optimizers must see every variable at their first build)."""
        with tf.init_scope():
            if is_keras3_object(self.outer_optimizer):
                keras = keras_of(self.outer_optimizer)
                anchor = [keras.Variable(v.read_value(), trainable=False, name="localsgd_anchor") for v in variables]
            else:
                anchor = [tf.Variable(v.read_value(), trainable=False, name="localsgd_anchor") for v in variables]
            self._build_outer(anchor)
        return anchor

    def _build_outer(self, anchor: Sequence[Any]) -> None:
        if not getattr(self.outer_optimizer, "built", False):  # Keras 3 builds once (another build adds variables)
            build_optimizer(self.outer_optimizer, anchor)

    def _anchor_values(self) -> List[tf.Variable]:
        """The anchor's tf.Variables (what TensorFlow reads and assigns)."""
        return [tf_variable(a) for a in self.anchor]

    def after_step(self) -> None:
        """Counts this rank's local step; every `sync_every` of them, `synchronize()`
        (collective)."""
        if not self._started:
            raise RuntimeError("LocalSGD.after_step() needs start(model, optimizer) first (collective over all "
                               "ranks; again after reset())")
        self.steps += 1
        self.pending += 1
        if self.pending >= self.sync_every:
            self.synchronize()

    def synchronize(self) -> None:
        """Collective: the pseudo-gradient anchor - mean(x_local) (one fused allreduce), the
        outer optimizer's step on the anchor, every rank's variables := the anchor."""
        if self._sync_fn is None:
            self._sync_fn = tf.function(self._sync_graph, autograph=False)
        self._sync_fn()
        self.pending = 0
        self.outer_steps += 1

    def _sync_graph(self) -> None:
        hvd = sys.modules["horovod.tensorflow"]
        means = hvd.grouped_allreduce([tf.convert_to_tensor(v) for v in self.variables], op=hvd.Average,
                                      name=SYNC_NAME)
        anchor = self._anchor_values()
        deltas = [a - m for a, m in zip(anchor, means)]
        self.outer_optimizer.apply_gradients(zip(deltas, self.anchor))
        for v, a in zip(self.variables, anchor):  # after the outer step: ordered on the anchor's resource
            v.assign(a.read_value())

    def end_epoch(self, epoch: int, logs: Optional[Mapping[str, Any]]) -> None:
        """With `sync_every_epoch` and local steps pending: `synchronize()` (collective)."""
        if self.sync_every_epoch and self._started and self.pending:
            self.synchronize()

    def finish(self) -> None:
        """Collective: the pending local steps synchronised, so every rank holds the anchor
        (the same model); nothing when none is pending. Idempotent."""
        if self._started and self.pending:
            self.synchronize()

    def close(self) -> None:
        """Nothing to release (the allreduce is Horovod's); the method needs start() again."""
        self._started = False

    def reset(self, topology: Any = None) -> None:
        """No transport to drop (Horovod's collectives follow the new membership); the counts
        stay. The next start() takes rank 0's model again (collective), abandoning the local
        steps since the last synchronisation."""
        self._started = False
        self.pending = 0

    def state(self) -> Dict[str, Any]:
        """{"steps", "outer_steps", "sync_every", "outer_optimizer": its Keras config (None before
        the first start() chose the default)} (JSON)."""
        outer = self.outer_optimizer
        config = keras_of(outer).optimizers.serialize(outer) if outer is not None else self._restored_outer
        return {"steps": self.steps, "outer_steps": self.outer_steps, "sync_every": self.sync_every,
                "outer_optimizer": config}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Takes back a `state()`: the counts, `sync_every` and the outer optimizer (rebuilt from
        its config where it differs; its momentum starts from zero)."""
        self.steps, self.outer_steps = int(state["steps"]), int(state["outer_steps"])
        self.sync_every = int(state["sync_every"])
        config = state.get("outer_optimizer")
        if self.outer_optimizer is None:  # the first start() builds it from the config (tf.keras', as the default)
            self._restored_outer = dict(config) if config is not None else None
            return
        keras = keras_of(self.outer_optimizer)
        if config is not None and config != keras.optimizers.serialize(self.outer_optimizer):
            self.outer_optimizer = keras.optimizers.deserialize(dict(config))
            self._sync_fn = None
            if self.anchor:  # the anchor's values kept, the new optimizer built on them
                with tf.init_scope():
                    self._build_outer(self.anchor)

    def stats(self) -> Dict[str, Any]:
        """{"method", "steps", "outer_steps", "pending", "sync_every"} of this rank."""
        return {"method": self.label, "steps": self.steps, "outer_steps": self.outer_steps, "pending": self.pending,
                "sync_every": self.sync_every}


def _horovod():
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is None or not hvd.is_initialized():
        raise RuntimeError("LocalSGD needs Horovod initialized: call hvdx.init() first")
    return hvd


def _trainable(model_or_variables: Any) -> List[tf.Variable]:
    """The trainable float variables of a Keras model of either Keras, or the given variables
    (checked), as tf.Variables (a Keras 3 variable's own)."""
    trainable = getattr(model_or_variables, "trainable_variables", None)
    variables: Sequence[Any] = list(trainable) if trainable is not None else list(model_or_variables)
    variables = [tf_variable(v) for v in variables]
    if not variables:
        raise ValueError("LocalSGD needs the model's trainable variables, got none (build the model first)")
    for v in variables:
        if not isinstance(v, tf.Variable) or not v.dtype.is_floating:
            raise ValueError(f"LocalSGD averages float tf.Variables; got {getattr(v, 'name', type(v).__name__)} "
                             f"({getattr(getattr(v, 'dtype', None), 'name', type(v).__name__)})")
    return list(variables)
