"""The registry of aggregation strategies: names, aliases, and building one from options.

A strategy module registers its class with `@register("name", aliases=(...))`; every module
of `hvdx.comm` is imported with the package, so adding a strategy touches its own module
only. The optimizer, the tape, the aggregator and the benchmarks ask the registry:

    cls = strategy_class("2dtar")                  # -> Hierarchical (aliases resolve)
    strategy = get("hitopk", density=0.01)         # validated once, by the class
    strategy = get("hierarchical", strict=False, density=0.01)   # options it does not take dropped
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Tuple, Type, TypeVar, Union

if TYPE_CHECKING:
    from hvdx.comm.base import Strategy

__all__ = ["get", "is_name", "names", "register", "resolve_name", "strategy_class", "takers"]

_BY_NAME: Dict[str, "Type[Strategy]"] = {}
_ALIASES: Dict[str, str] = {}
S = TypeVar("S", bound="Type[Strategy]")


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


def strategy_class(strategy: str) -> "Type[Strategy]":
    """The class registered under a name or alias; ValueError if unknown."""
    return _BY_NAME[resolve_name(strategy)]


def takers(option: str) -> List[str]:
    """The names of the strategies that take `option`, sorted."""
    return sorted(key for key, cls in _BY_NAME.items() if option in cls.options)


def get(strategy: Union[str, "Strategy"], *, strict: bool = True, **options) -> "Strategy":
    """A strategy from its name (built by `Strategy.from_options`) or an instance (kept as is).

    Args:
      strategy: a registered name or alias, or an `hvdx.comm.Strategy` instance.
      strict: options the strategy does not take raise ValueError (True) or are dropped
        (False: switching strategies keeps the options that apply).
      options: the strategy's options (`cls.options` lists them).
    Raises:
      ValueError: unknown name, an option the strategy does not take (strict), a bad
        value, or options given beside an instance (configure the instance itself).
    """
    from hvdx.comm.base import Strategy

    if isinstance(strategy, Strategy):
        if options:
            raise ValueError(f"options {sorted(options)} given with a strategy instance {strategy!r}: "
                             "configure the instance itself, e.g. hvdx.comm.HiTopK(density=0.01)")
        return strategy
    return strategy_class(strategy).from_options(strict=strict, **options)
