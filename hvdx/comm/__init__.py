"""Gradient aggregation strategies on one fused 1-D buffer (DESIGN.md "One training step").

| name               | class             | paper                                   |
| ------------------ | ----------------- | --------------------------------------- |
| "allreduce"        | Allreduce         | dense baseline (Horovod allreduce)      |
| "hierarchical"     | Hierarchical      | 2DTAR, shi2021 sec. 5.3                 |
| "sparse_allgather" | SparseAllgather   | NaiveAG: MSTopK + global all-gather     |
| "hitopk"           | HiTopK            | HiTopKComm, shi2021 Algorithm 2         |
"""
from __future__ import annotations

from typing import Union

from hvdx.comm.base import ResidualMemory, Strategy
from hvdx.comm.dense import Allreduce, Hierarchical
from hvdx.comm.sparse import HiTopK, SparseAllgather

__all__ = ["Allreduce", "Hierarchical", "HiTopK", "ResidualMemory", "SparseAllgather", "Strategy", "get"]

_BY_NAME = {cls.key: cls for cls in (Allreduce, Hierarchical, SparseAllgather, HiTopK)}
_ALIASES = {"dense": "allreduce", "2dtar": "hierarchical", "naiveag": "sparse_allgather",
            "hitopkcomm": "hitopk"}


def get(strategy: Union[str, Strategy], **kwargs) -> Strategy:
    """A strategy from its name (kwargs go to its constructor) or an instance (kept as is)."""
    if isinstance(strategy, Strategy):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} given with a strategy instance {strategy!r}")
        return strategy
    if not isinstance(strategy, str):
        raise ValueError(f"communication must be a strategy name or instance, got {strategy!r}")
    key = _ALIASES.get(strategy.lower(), strategy.lower())
    if key not in _BY_NAME:
        raise ValueError(f"unknown communication strategy {strategy!r}; choose one of "
                         f"{sorted(_BY_NAME)} (or aliases {sorted(_ALIASES)})")
    cls = _BY_NAME[key]
    if cls in (Allreduce, Hierarchical):  # dense: the sparsification options do not apply
        kwargs = {k: v for k, v in kwargs.items() if k not in ("density", "num_samplings", "wire_dtype")}
    return cls(**kwargs)
