"""What a strategy needs to know about the optimizer it serves, declared rather than detected.

A strategy decides the convergence aids it applies by default for an optimizer
(`hvdx.comm.Strategy.defaults_for`) from the optimizer's `OptimizerTraits`:

    traits_of(tf.keras.optimizers.SGD(0.1, momentum=0.9))   # OptimizerTraits(name='SGD', momentum=0.9)
    traits_of(tf.keras.optimizers.Adam())                   # OptimizerTraits(name='Adam', adaptive=True)

An optimizer declares its own traits with a method or class attribute `hvdx_traits`
(hvdx's LARS and LAMB do); the built-in optimizers of either Keras (Keras 2's, tf_keras
included, and Keras 3's) are described here from their classes; any other optimizer has none
(`OptimizerTraits(name=...)`: no aid by default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from hvdx import legacy_keras
from hvdx.arguments import is_real, real

__all__ = ["ADAM_FAMILY", "OptimizerTraits", "TRUST_RATIOS", "traits_of"]

#: The kinds of layer-wise trust ratio (`OptimizerTraits.trust_ratio`).
TRUST_RATIOS = ("gradient", "step")



def _classes(namespace: Any, names: Tuple[str, ...]) -> Tuple[type, ...]:
    """The classes of `names` that `namespace` has (Keras 3's tf.keras.optimizers.legacy has
    no Adamax or Nadam)."""
    return tuple(cls for cls in (getattr(namespace, name, None) for name in names) if isinstance(cls, type))


try:  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)
    _keras2 = legacy_keras.keras2()
except legacy_keras.Keras2Missing:  # Keras 3 alone: no Keras 2 optimizer can be given
    _keras2 = None

#: Keras 2's optimizers with Adam's per-coordinate moments (subclasses included): Adam,
#: AdamW, Adamax, Nadam and their legacy versions, those the installed Keras 2 has.
ADAM_FAMILY = (_classes(_keras2.optimizers, ("Adam", "AdamW", "Adamax", "Nadam"))
               + _classes(_keras2.optimizers.legacy, ("Adam", "Adamax", "Nadam"))) if _keras2 else ()


@dataclass(frozen=True)
class OptimizerTraits:
    """What kind of update an optimizer makes, as far as the strategies' defaults care.

    name: the optimizer's class name (for messages).
    momentum: its heavy-ball momentum on the gradient, where it is a plain number that
      hvdx's wrapper can set to 0 in the step (DGC's momentum correction moves it into the
      strategy); None otherwise (no momentum, or one the wrapper cannot zero: Keras'
      legacy SGD).
    nesterov: the momentum is Nesterov's.
    adaptive: per-coordinate moments (the Adam family, LAMB).
    trust_ratio: its layer-wise trust ratio measures "gradient" (LARS with classic
      momentum, eq. 11: it can be applied to each rank's gradient before aggregation; the
      optimizer then implements `local_trusted(grads, variables)` and the context manager
      `trust_applied(on)`, hvdx.optimizers.LARS) or "step" (the update it makes: LAMB, LARS
      with classic_momentum=False); None: no trust ratio.
    """

    name: str = "optimizer"
    momentum: Optional[float] = None
    nesterov: bool = False
    adaptive: bool = False
    trust_ratio: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "momentum", real(self.momentum, "OptimizerTraits.momentum", optional=True,
                                                  expected="a number or None"))
        if self.trust_ratio not in (None, *TRUST_RATIOS):
            raise ValueError(f"OptimizerTraits.trust_ratio must be one of {TRUST_RATIOS} or None, got "
                             f"{self.trust_ratio!r}")


def plain_number(value: Any) -> Optional[float]:
    """`value` as a float where it is a plain number (int, float, NumPy's; not a bool, tensor or variable),
    else None."""
    return float(value) if is_real(value) else None


def traits_of(optimizer: Any) -> OptimizerTraits:
    """The traits of `optimizer`: its own declaration (`hvdx_traits()`, or a class attribute
    `hvdx_traits` holding an OptimizerTraits), else the SGD of its Keras (that class itself: a
    subclass may change the update) and that Keras' Adam family (Keras 2's: `ADAM_FAMILY`)
    described from their classes, else none.

    Raises:
      TypeError: a declaration that is not an OptimizerTraits.
    """
    name = type(optimizer).__name__
    declared = getattr(type(optimizer), "hvdx_traits", None)
    if declared is not None:
        traits = declared if isinstance(declared, OptimizerTraits) else optimizer.hvdx_traits()
        if not isinstance(traits, OptimizerTraits):
            raise TypeError(f"{name}.hvdx_traits must be (or return) an hvdx.comm.traits.OptimizerTraits, got "
                            f"{traits!r}")
        return traits
    sgd, adam_family = _keras3_classes() if legacy_keras.is_keras3_object(optimizer) else (
        _keras2.optimizers.SGD if _keras2 is not None else None, ADAM_FAMILY)
    if type(optimizer) is sgd:
        return OptimizerTraits(name=name, momentum=plain_number(optimizer.momentum),
                               nesterov=bool(optimizer.nesterov))
    if isinstance(optimizer, adam_family):
        return OptimizerTraits(name=name, adaptive=True)
    return OptimizerTraits(name=name)


def _keras3_classes() -> Tuple[type, Tuple[type, ...]]:
    """Keras 3's SGD and its Adam family (subclasses included), for a Keras 3 optimizer (Keras 3
    is loaded then)."""
    import keras

    return keras.optimizers.SGD, _classes(keras.optimizers, ("Adam", "AdamW", "Adamax", "Nadam"))
