"""What lets an optimizer wrapper pass for the Keras optimizer it wraps, as Horovod's does
(Horovod's wrapper is a subclass of the wrapped optimizer's class, `type(cls.__name__, (cls,), ...)`).

- Its class. `subclass_for(wrapper, wrapped)` is a subclass of `wrapper` that has the
  wrapped optimizer's class among its bases, made once per pair: `isinstance(opt,
  tf.keras.optimizers.SGD)` holds for a wrapped SGD. It behaves exactly as `wrapper`: an
  attribute the wrapped class adds to Keras' Optimizer is read from the wrapped optimizer
  (as the wrapper's `__getattr__` reads instance attributes), one it overrides is Keras'
  Optimizer's; it has `wrapper`'s name and serialises under `wrapper`'s registered name.
  Only new-style Keras optimizers get one: a legacy optimizer's wrapper stays a new-style
  Optimizer (were it also a `tf.keras.optimizers.legacy.Optimizer`, Keras would take it
  for a legacy one, e.g. put it under the legacy LossScaleOptimizer, which calls the
  legacy optimizer API on it).
- Its momentum. Keras' new SGD (and hvdx's LARS) hold `momentum` as a Python number, which
  a traced step reads as a constant, so Horovod's LR callbacks cannot assign it
  (`tf.keras.backend.set_value(opt.momentum, m)`: "'float' object has no attribute
  'dtype'", with Horovod's wrapper too). `Momentum` keeps it in a variable that the wrapped
  optimizer's step reads while the wrapper traces it (`Momentum.read_by_step`).
- What it must not wrap: `check_not_horovods(optimizer, wrapper)` refuses Horovod's own
  DistributedOptimizer (its gradients would be averaged twice, once per wrapper).
- What an asynchronous method must not run with: `check_not_synchronous` refuses an
  optimizer whose class declares `SYNCHRONOUS_MARKER` (hvdx's wrappers, DASO) or Horovod's.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import tensorflow as tf

from hvdx import legacy_keras
from hvdx.arguments import is_real

from hvdx import wrapper_core

# What follows subclasses Keras 2's optimizers (tf.keras where it is Keras 2, else tf_keras).
keras2 = legacy_keras.keras2()

__all__ = ["Momentum", "SYNCHRONOUS_MARKER", "check_not_horovods", "check_not_synchronous", "is_horovods",
           "is_synchronous", "subclass_for"]

#: The class attribute by which an optimizer declares that its step reads `self.momentum`
#: through TensorFlow ops only (a variable works there; hvdx's LARS). Keras' SGD does too;
#: RMSprop, e.g., branches on `self.momentum > 0` in Python.
MOMENTUM_READ_BY_OPS = "momentum_read_by_ops"


def _reads_momentum_by_ops(optimizer) -> bool:
    return isinstance(optimizer, keras2.optimizers.SGD) or getattr(type(optimizer), MOMENTUM_READ_BY_OPS, False) is True



def is_horovods(optimizer) -> bool:
    """Whether `optimizer` is Horovod's DistributedOptimizer: tf.compat.v1's (a class of
    horovod.tensorflow), or Keras' (a class named like the wrapped optimizer's that holds
    the methods of Horovod's `_DistributedOptimizer`)."""
    for cls in type(optimizer).__mro__:
        if (cls.__module__ or "").startswith("horovod.") and "DistributedOptimizer" in cls.__name__:
            return True
        if any((getattr(value, "__module__", None) or "").startswith("horovod.")
               and "_DistributedOptimizer" in (getattr(value, "__qualname__", None) or "")
               for value in vars(cls).values()):
            return True
    return False


#: The class attribute that declares an optimizer wrapper synchronous: True where the wrapper
#: averages the gradients over ranks in every step (hvdx.DistributedOptimizer, and so DASO,
#: PartialDistributedOptimizer and every class `subclass_for` makes from them).
SYNCHRONOUS_MARKER = "averages_gradients_every_step"


def is_synchronous(optimizer) -> bool:
    """Whether `optimizer` itself (not what it wraps) averages gradients over ranks in every
    step: its class declares `SYNCHRONOUS_MARKER`, or it is Horovod's DistributedOptimizer
    (`is_horovods`, or any class of a `horovod.` module), or, for another library's wrapper
    that declares nothing, a class in its hierarchy is named `DistributedOptimizer`."""
    cls = type(optimizer)
    if getattr(cls, SYNCHRONOUS_MARKER, False) is True or is_horovods(optimizer):
        return True
    return (cls.__module__ or "").startswith("horovod.") or any(k.__name__ == "DistributedOptimizer"
                                                                 for k in cls.__mro__)


def check_not_synchronous(optimizer, method: str, example: str = "tf.keras.optimizers.SGD(0.1)") -> None:
    """Raises ValueError when `optimizer`, or an optimizer it wraps (`inner_optimizer`),
    averages gradients over all ranks every step (`is_synchronous`: an hvdx or Horovod
    DistributedOptimizer, DASO or a subclass of either): an asynchronous `method` replaces
    that averaging, it does not add to it.

    Args:
      optimizer: what the user passed.
      method: the asynchronous method's name in the message ("AD-PSGD").
      example: a plain optimizer to pass instead, for the message.
    """
    seen = optimizer
    while seen is not None:
        if is_synchronous(seen):
            module = type(seen).__module__ or ""
            raise ValueError(f"{method} cannot run with the synchronous {type(seen).__name__} ({module}): it "
                             f"would average the gradients over all ranks every step, the very wait {method} "
                             f"removes. Pass the plain Keras optimizer (e.g. {example}).")
        seen = getattr(seen, "inner_optimizer", None)


def check_not_horovods(optimizer, wrapper: str, why: str = "its gradients would be averaged twice, by Horovod's "
                       "wrapper and by hvdx's", kind: str = "tf.keras",
                       example: str = "tf.keras.optimizers.SGD(...)") -> None:
    """Raises ValueError when `optimizer` is Horovod's DistributedOptimizer (`is_horovods`).

    Args:
      optimizer: what the user passed to `wrapper`.
      wrapper: the wrapper's name in the message ("hvdx.DistributedOptimizer").
      why: what wrapping Horovod's would do.
      kind, example: the kind of optimizer `wrapper` takes, and one, for the message.
    """
    if is_horovods(optimizer):
        raise ValueError(f"{wrapper} wraps a plain {kind} optimizer and aggregates its gradients itself; got "
                         f"Horovod's DistributedOptimizer ({why}): pass the optimizer it wraps, "
                         f"{wrapper}({example}, ...)")


def subclass_for(wrapper: type, wrapped: type) -> type:
    """The class of a `wrapper` instance that wraps a `wrapped` instance: `wrapper` itself
    unless `wrapped` is a new-style Keras optimizer (and no wrapper), else the subclass of
    both described in the module docstring, one per pair, registered with Keras 2
    (`hvdx.wrapper_core.subclass_for`)."""
    return wrapper_core.subclass_for(wrapper, wrapped, keras2.optimizers.Optimizer,
                                     keras2.utils.get_registered_name, keras2.utils.register_keras_serializable)


class Momentum:
    """The momentum of a wrapped optimizer. Where the wrapped optimizer holds it as a Python
    number that its step reads through TensorFlow ops only (Keras' SGD, hvdx's LARS:
    `held`), the momentum is also a float32 variable, which the step reads while the
    wrapper calls the wrapped optimizer's apply_gradients inside `read_by_step()`. The
    variable is not tracked: checkpoints and configs keep the wrapped optimizer's number
    (Horovod's momentum correction assigns the variable for one step and restores it). A
    new number set on the wrapped optimizer reaches the variable at the next trace."""

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer
        number = getattr(optimizer, "momentum", None)
        self.held = _reads_momentum_by_ops(optimizer) and is_real(number)
        self._variable: Optional[tf.Variable] = None
        self._number = None

    def get(self):
        """The variable where `held`, else the wrapped optimizer's own `momentum` (AttributeError
        if it has none)."""
        if not self.held:
            return getattr(self._optimizer, "momentum")
        number = self._optimizer.__dict__["momentum"]
        with tf.init_scope():
            if self._variable is None:
                self._variable = tf.Variable(float(number), dtype=tf.float32, trainable=False, name="momentum")
            elif number != self._number:  # set on the wrapped optimizer since
                self._variable.assign(float(number))
        self._number = number
        return self._variable

    def set(self, value) -> None:
        """Sets the wrapped optimizer's momentum (and the variable where `held`)."""
        self._optimizer.momentum = value
        if self.held:
            self.get().assign(float(value))

    @contextlib.contextmanager
    def read_by_step(self, zero: bool = False, variables: Sequence = ()) -> Iterator[None]:
        """Where `held`, the wrapped optimizer's `momentum` is the variable inside (set
        without tracking, so no checkpoint sees it); with `zero`, 0 instead (DGC's momentum
        correction: the strategy applied the momentum before aggregating).

        With `zero`, Keras 2's SGD also steps without its momentum slots: its step otherwise
        computes m = -lr g + 0 m, assigns m and adds it (three more passes over every
        variable than var += -lr g, as Keras 3's SGD does at momentum 0). It is built on
        `variables` first (as its apply_gradients would), and the slots keep their values
        for when the momentum is its own again (a strategy switch).

        Args:
          zero: apply without momentum.
          variables: the variables the step applies to (built on, where not built yet).
        """
        if not self.held:
            yield
            return
        number = self._optimizer.__dict__["momentum"]
        variable = tf.zeros([], tf.float32) if zero else self.get()
        object.__setattr__(self._optimizer, "momentum", variable)
        slots = self._slots_set_aside(variables) if zero else None
        try:
            yield
        finally:
            object.__setattr__(self._optimizer, "momentum", number)
            if slots is not None:
                self._optimizer.momentums = slots

    def _slots_set_aside(self, variables: Sequence) -> Optional[list]:
        """Keras 2 SGD's momentum slots, replaced by None in the optimizer (built on
        `variables` first); None for any other optimizer."""
        optimizer = self._optimizer
        if not isinstance(optimizer, keras2.optimizers.SGD) or not variables:
            return None
        with tf.name_scope(optimizer.name or "optimizer"), tf.init_scope():
            optimizer.build(list(variables))  # a no-op where built
        slots = optimizer.momentums
        optimizer.momentums = [None] * len(slots)
        return slots
