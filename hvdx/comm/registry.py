"""The registry of aggregation strategies: names, aliases, and building one from options.

A strategy module registers its class with `@register("name", aliases=(...))`; every module
of `hvdx.comm` is imported with the package, so adding a strategy touches its own module
only. The optimizer, the tape, the aggregator and the benchmarks ask the registry:

    cls = strategy_class("2dtar")                  # -> Hierarchical (aliases resolve)
    takers("density")                              # -> the strategies that take a density

It knows classes by name only (no hvdx module imported): building a strategy from a name and
options is `hvdx.comm.get` (`hvdx.comm.base`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple, TypeVar

__all__ = ["is_name", "names", "register", "resolve_name", "strategy_class", "takers"]

_BY_NAME: Dict[str, type] = {}  # name -> a subclass of hvdx.comm.Strategy
_ALIASES: Dict[str, str] = {}
S = TypeVar("S", bound=type)


def register(name: str, *, aliases: Tuple[str, ...] = ()) -> Callable[[S], S]:
    """Class decorator: makes the strategy known as `name` (and its aliases, any case).

    Sets `cls.key = name`. Raises ValueError if the name or an alias is taken by another
    class (re-registering the same class, e.g. on a module reload, is allowed)."""

    def decorate(cls: S) -> S:
        key = name.lower()
        for label in (key, *(a.lower() for a in aliases)):
            owner = _BY_NAME.get(label) or _BY_NAME.get(_ALIASES.get(label, ""))
            if owner is not None and owner.__qualname__ != cls.__qualname__:
                raise ValueError(f"strategy name {label!r} is taken by {owner.__qualname__}")
        cls.key = key
        _BY_NAME[key] = cls
        _ALIASES.update({a.lower(): key for a in aliases})
        return cls

    return decorate


def names() -> List[str]:
    """The canonical names of the registered strategies, sorted."""
    return sorted(_BY_NAME)


def is_name(value: object) -> bool:
    """Whether `value` is a registered strategy name or alias (any case)."""
    return isinstance(value, str) and (value.lower() in _BY_NAME or value.lower() in _ALIASES)


def resolve_name(strategy: str) -> str:
    """The canonical name of a strategy name or alias; ValueError if unknown."""
    if not isinstance(strategy, str):
        raise ValueError(f"communication must be a strategy name or an hvdx.comm.Strategy, got {strategy!r}")
    key = _ALIASES.get(strategy.lower(), strategy.lower())
    if key not in _BY_NAME:
        raise ValueError(f"unknown communication strategy {strategy!r}; choose one of "
                         f"{names()} (or aliases {sorted(_ALIASES)})")
    return key


def strategy_class(strategy: str) -> type:
    """The class registered under a name or alias; ValueError if unknown."""
    return _BY_NAME[resolve_name(strategy)]


def takers(option: str) -> List[str]:
    """The names of the strategies that take `option`, sorted."""
    return sorted(key for key, cls in _BY_NAME.items() if option in cls.options)
