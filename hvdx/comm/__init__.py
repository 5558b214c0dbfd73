"""Gradient aggregation strategies on one fused 1-D buffer (DESIGN.md "One training step").

| name               | class             | module      | paper                              |
| ------------------ | ----------------- | ----------- | ---------------------------------- |
| "allreduce"        | Allreduce         | dense.py    | dense baseline (Horovod allreduce) |
| "hierarchical"     | Hierarchical      | dense.py    | 2DTAR, shi2021 sec. 5.3            |
| "sparse_allgather" | SparseAllgather   | naiveag.py  | NaiveAG: MSTopK + global all-gather|
| "hitopk"           | HiTopK            | hitopk.py   | HiTopKComm, shi2021 Algorithm 2    |

What selects (MSTopK, `hvdx.ops`), what remembers (`memory.ResidualMemory`) and what
communicates (the strategies, with `wire` packing) are separate pieces.
"""
from __future__ import annotations

from typing import Union

from hvdx.comm.base import Aggregated, Strategy
from hvdx.comm.dense import Allreduce, Hierarchical
from hvdx.comm.hitopk import HiTopK
from hvdx.comm.memory import ResidualMemory
from hvdx.comm.naiveag import SparseAllgather
from hvdx.comm.sparse import DEFAULT_DENSITY, TopKStrategy

__all__ = ["Aggregated", "Allreduce", "DEFAULT_DENSITY", "Hierarchical", "HiTopK", "ResidualMemory",
           "SparseAllgather", "Strategy", "TopKStrategy", "get", "resolve_name"]

_BY_NAME = {cls.key: cls for cls in (Allreduce, Hierarchical, SparseAllgather, HiTopK)}
_ALIASES = {"dense": "allreduce", "2dtar": "hierarchical", "naiveag": "sparse_allgather",
            "hitopkcomm": "hitopk"}


def resolve_name(strategy: str) -> str:
    """The canonical name of a strategy name or alias; ValueError if unknown."""
    if not isinstance(strategy, str):
        raise ValueError(f"communication must be a strategy name or an hvdx.comm.Strategy, got {strategy!r}")
    key = _ALIASES.get(strategy.lower(), strategy.lower())
    if key not in _BY_NAME:
        raise ValueError(f"unknown communication strategy {strategy!r}; choose one of "
                         f"{sorted(_BY_NAME)} (or aliases {sorted(_ALIASES)})")
    return key


def get(strategy: Union[str, Strategy], **kwargs) -> Strategy:
    """A strategy from its name (kwargs go to its constructor) or an instance (kept as is).

    Options that do not apply to the strategy are rejected, not ignored: a density given
    to a dense strategy, or any option given with an instance.
    """
    if isinstance(strategy, Strategy):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} given with a strategy instance {strategy!r}: "
                             "configure the instance itself")
        return strategy
    cls = _BY_NAME[resolve_name(strategy)]
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"communication={strategy!r} does not take {sorted(kwargs)}: {exc}") from None
