"""Horovod's Keras callbacks for Keras 3 models (`keras.callbacks.Callback`), same names,
arguments (order, defaults) and semantics as `horovod.tensorflow.keras.callbacks`:

    from hvdx.keras import keras3_callbacks as cb
    model.fit(x, y, callbacks=[cb.BroadcastGlobalVariablesCallback(0), cb.MetricAverageCallback(),
                               cb.LearningRateWarmupCallback(initial_lr=0.1 * hvdx.size())])

Why Horovod 0.28.1's fail under Keras 3: they read and set hyper-parameters through Keras 2's
backend (`K.get_value` / `set_value` on `optimizer.lr`), call `optimizer.variables()` (a list
property in Keras 3), and `hvd.broadcast_variables` cannot assign a Keras 3 variable
("'SymbolicTensor' object has no attribute 'assign'"). What differs from Horovod's:

- the broadcast runs before the first step (Keras 3's `fit` builds the optimizer at the first
  step's trace, after `on_train_begin`: the callback builds it first, as Keras would), after
  `check_same_steps`; a model not built by then is broadcast after the first batch, as Horovod
  does. hvdx's wrapper's residuals (per rank) are never broadcast.
- metrics are averaged in one float64 allreduce over the sorted numeric keys, after a check
  that every rank has the same keys (RankMismatchError otherwise, naming ranks and keys).
- the rate is set by `optimizer.learning_rate.assign`; momentum correction scales SGD's stored
  velocity instead of its momentum (see `LearningRateScheduleCallback`).
- `BestModelCheckpoint` checks its (possibly later set) `filepath` by Keras 3's rules.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvdx.agreement import RankMismatchError, describe_differences
from hvdx.callbacks.broadcast import check_same_steps
from hvdx.variables import broadcast_variables, tf_variable

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback", "warmup_multiplier"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Every rank's model and optimizer variables take `root_rank`'s, once per callback
    instance (Horovod's `broadcast_done`: a second `fit` does not broadcast again).

    At `on_train_begin` of every fit: `check_same_steps(self.params)` (collective). Then, the
    first time, if the model is built: its optimizer is built on `model.trainable_variables`
    (what Keras 3 does at the first step) and `model.variables` + `optimizer.variables` are
    broadcast before the first step. An unbuilt model (its variables appear in the first step)
    is broadcast at the end of the first batch instead. Excluded: `local_variables`, and hvdx's
    DistributedOptimizer's residuals (`optimizer.aggregator.residuals`, per rank; its
    `variables` are the wrapped optimizer's).
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Optional[Iterable[Any]] = None) -> None:
        super().__init__()
        self.root_rank, self.device = root_rank, device
        self.broadcast_done = False
        local = [] if local_variables is None else (
            [local_variables] if hasattr(local_variables, "assign") else list(local_variables))
        self._local = [tf_variable(v) for v in local]  # held: their ids stay theirs

    def register_local_var(self, var: Any) -> None:
        """`var` is kept per rank: never broadcast (Horovod's)."""
        self._local.append(tf_variable(var))

    def variables_to_broadcast(self) -> List[Any]:
        """The model's variables, then its optimizer's, less the local ones and residuals."""
        optimizer = self.model.optimizer
        opt_vars = list(optimizer.variables) if optimizer is not None else []
        aggregator = getattr(optimizer, "aggregator", None)
        skip = {id(tf_variable(v)) for v in self._local + list(getattr(aggregator, "residuals", []))}
        return [v for v in list(self.model.variables) + opt_vars if id(tf_variable(v)) not in skip]

    def _broadcast(self) -> None:
        with tf.device(self.device):
            broadcast_variables(self.variables_to_broadcast(), root_rank=self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        check_same_steps(self.params or {})
        if not self.broadcast_done and self.model.built:
            optimizer = self.model.optimizer
            if optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end every numeric scalar in `logs` becomes its average over the ranks
    (a float), for the callbacks after it (place it before ReduceLROnPlateau, checkpoints,
    ...). Collective: the ranks first all-gather their sorted numeric keys (RankMismatchError
    on every rank, naming who differs, if they differ), then one allreduce (Average, float64,
    keys in sorted order) averages them all. Other entries are left as they are."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        logs = {} if logs is None else logs  # still collective: the others wait for this rank
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.asarray(v).dtype.kind in "iuf")
        gathered = hvd.allgather_object((hvd.rank(), {"metrics": ", ".join(keys)}), name="hvdx.metric_average.keys")
        lines = describe_differences([d for _, d in gathered], [r for r, _ in gathered])
        if lines:
            raise RankMismatchError("hvdx.MetricAverageCallback: the ranks log different metrics at the end of "
                                    f"epoch {epoch}; every rank must log the same ones:\n  " + "\n  ".join(lines))
        if not keys:
            return
        with tf.device(self.device):
            values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
            averaged = hvd.allreduce(values, op=hvd.Average, name="hvdx.metric_average").numpy()
        logs.update({k: float(v) for k, v in zip(keys, averaged)})


def warmup_multiplier(epoch: float, size: int, warmup_epochs: float, steps_per_epoch: int) -> float:
    """Horovod's warm-up factor (Goyal et al.) at fractional `epoch` = epoch + batch /
    steps_per_epoch: 1/size * ((epoch + 1/steps_per_epoch) * (size - 1) / warmup_epochs + 1),
    from about 1/size at the first batch to 1 at the last batch of epoch warmup_epochs - 1."""
    epoch += 1.0 / steps_per_epoch
    return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the rate to `initial_lr * multiplier(epoch)` for start_epoch <= epoch < end_epoch
    (`multiplier` a function, or a constant c: c ** (epoch - start_epoch)): at each epoch's
    first batch with an integer epoch (`staircase`), else before every batch with epoch +
    batch / steps_per_epoch (`steps_per_epoch` default: Keras' `params["steps"]`). Logs the
    rate as `logs["lr"]` at each epoch's end. The rate is `optimizer.learning_rate.assign(..)`:
    ValueError at `on_train_begin` if the optimizer has a LearningRateSchedule.

    Momentum correction (Goyal et al., Horovod's `momentum_correction`): when the rate changes
    from lr_old to lr_new, Horovod multiplies the momentum m by r = lr_new / lr_old for that
    one step. Keras 3's SGD reads m as a Python number when its step is traced, so instead the
    stored velocity v of its update v <- m * v - lr * g, w <- w + v is multiplied by r before
    the step: m * (r * v) - lr_new * g = (m * r) * v - lr_new * g, Horovod's update (with
    nesterov=True the look-ahead term keeps m). Done on the innermost SGD (`inner_optimizer`)
    when built with a momentum; nothing for other optimizers (without velocity buffers, or
    RMSprop's, uncorrected), when lr_old is 0, nor under hvdx's momentum correction (the
    wrapper's strategy holds the velocity, u <- m * u + g, which carries no rate; the wrapped
    SGD runs with momentum 0).
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]], start_epoch: int = 0,
                 end_epoch: Optional[int] = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction, self.steps_per_epoch = staircase, momentum_correction, steps_per_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        self.current_epoch: Optional[int] = None

    def _rate(self) -> Any:
        rate = self.model.optimizer.learning_rate
        if not isinstance(rate, keras.Variable):
            raise ValueError(f"{type(self).__name__} needs a float learning rate (a variable it assigns), not a "
                             f"LearningRateSchedule: give the optimizer learning_rate=<float>")
        return rate

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self._rate()
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError("Could not autodetect the number of steps per epoch (Keras' params have no "
                                 f"'steps'): pass steps_per_epoch to {type(self).__name__}()")

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def _adjust(self, epoch: float) -> None:
        rate = self._rate()
        old, new = float(rate.numpy()), self.initial_lr * self.multiplier(epoch)
        rate.assign(new)
        if self.momentum_correction and old != 0.0 and new != old:
            for velocity in self._velocities():
                velocity.assign(velocity * (new / old))

    def _velocities(self) -> List[Any]:
        """The SGD velocity buffers momentum correction scales (see the class), else []."""
        optimizer = self.model.optimizer
        if getattr(getattr(optimizer, "communication", None), "corrects_momentum", False):  # hvdx's (DGC's)
            return []
        sgd = optimizer
        while getattr(sgd, "inner_optimizer", None) is not None:
            sgd = sgd.inner_optimizer
        if not isinstance(sgd, keras.optimizers.SGD) or not sgd.built or not sgd.momentum:
            return []
        return list(sgd.momentums)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is not None:
            logs["lr"] = float(self._rate().numpy())


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warm-up, Horovod's: before every batch of the first
    `warmup_epochs` epochs lr = initial_lr * warmup_multiplier(epoch + batch / steps_per_epoch,
    hvd.size(), ...), from about initial_lr / size to initial_lr at the last warm-up batch."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        super().__init__(initial_lr, lambda epoch: warmup_multiplier(epoch, hvd.size(), warmup_epochs,
                                                                     self.steps_per_epoch),
                         start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {float(self._rate().numpy()):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's: Keras' ModelCheckpoint with save_best_only=True, whose `filepath` may be set
    later (Horovod's Spark estimator does), checked by Keras 3's rules when set: it must end
    in `.weights.h5` with save_weights_only, else `.keras` (or legacy `.h5`); ValueError at
    `on_train_begin` if still None. It saves on the rank it is given to (give it to one)."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: Union[str, int] = "epoch", filepath: Optional[str] = None) -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"  # Keras' check needs a path
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = filepath

    @property
    def filepath(self) -> Optional[str]:
        return self._filepath

    @filepath.setter
    def filepath(self, value: Optional[str]) -> None:
        value = None if value is None else str(value)
        weights_only = getattr(self, "save_weights_only", None)
        if value is not None and weights_only is not None:
            suffixes = (".weights.h5",) if weights_only else (".keras", ".h5")
            if not value.endswith(suffixes):
                raise ValueError(f"BestModelCheckpoint: with save_weights_only={weights_only} the filepath must "
                                 f"end in {' or '.join(suffixes)} (Keras 3), got {value!r}")
        self._filepath = value

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint: set `filepath` before fit")
        super().on_train_begin(logs)
