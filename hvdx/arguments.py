"""The checks of numeric arguments every public entry point shares: an int argument takes any
integer, NumPy's included, and a real one any real number, NumPy's included.

Both checks return the value as a Python `int` / `float`, so what is stored never carries a
NumPy type into a tf.function's signature, a Keras config or a JSON state. bool is refused
(it is an int to Python, never a count or a size to a user). The standard library only: every
layer may use it.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional

__all__ = ["integer", "is_integer", "is_real", "real"]


def is_integer(value: Any) -> bool:
    """Whether `value` is an integer (int, NumPy integers; any `numbers.Integral`), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether `value` is a real number (int, float, NumPy's; any `numbers.Real`), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int_bounds(minimum: Optional[int], maximum: Optional[int]) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def integer(value: Any, name: str, minimum: Optional[int] = None, maximum: Optional[int] = None, *,
            optional: bool = False, expected: Optional[str] = None) -> Optional[int]:
    """`value` as a Python int, checked.

    Args:
      value: the argument: an int or a NumPy integer (any `numbers.Integral` but bool).
      name: the argument's name, as the user wrote it (the error names it).
      minimum, maximum: inclusive bounds (None: none).
      optional: None is accepted (and returned).
    Returns:
      int(value), or None for None when `optional`.
    Raises:
      ValueError: a bool, a float (2.0 included), a string, None unless `optional`, or a value
        outside the bounds: "`name` must be `expected`, got `value`", where `expected` defaults
        to the type and bounds ("an int >= 1", "an int in [0, 7]", "... or None").
    """
    if value is None and optional:
        return None
    if not is_integer(value) or (minimum is not None and value < minimum) or (
            maximum is not None and value > maximum):
        if expected is None:
            expected = _int_bounds(minimum, maximum) + (" or None" if optional else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def _interval(low: Optional[float], high: Optional[float], low_open: bool, high_open: bool) -> str:
    lower = "(-inf" if low is None else f"{'(' if low_open else '['}{low}"
    upper = "inf)" if high is None else f"{high}{')' if high_open else ']'}"
    return f"{lower}, {upper}"


def real(value: Any, name: str, low: Optional[float] = None, high: Optional[float] = None, *,
         low_open: bool = False, high_open: bool = False, optional: bool = False,
         expected: Optional[str] = None) -> Optional[float]:
    """`value` as a Python float, checked.

    Args:
      value: the argument: an int, a float or a NumPy number (any `numbers.Real` but bool).
      name: the argument's name, as the user wrote it (the error names it).
      low, high: the interval's ends (None: unbounded); closed unless `low_open` / `high_open`.
      optional: None is accepted (and returned).
    Returns:
      float(value), or None for None when `optional`.
    Raises:
      ValueError: a bool, NaN, a string, None unless `optional`: "`name` must be a number,
        got `value`"; a number outside the interval: "`name` must be in [low, high), got
        `value`". `expected`, where given, replaces both descriptions ("`name` must be
        `expected`, got `value`").
    """
    if value is None and optional:
        return None
    if not is_real(value) or math.isnan(value):
        raise ValueError(f"{name} must be {expected or 'a number'}, got {value!r}")
    number = float(value)
    if (low is not None and (number < low or (low_open and number == low))) or (
            high is not None and (number > high or (high_open and number == high))):
        raise ValueError(f"{name} must be {expected or 'in ' + _interval(low, high, low_open, high_open)}, "
                         f"got {value!r}")
    return number
