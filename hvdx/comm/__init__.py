"""Gradient aggregation strategies on one fused 1-D buffer (docs/comm.md).

| name               | aliases    | class           | module          | paper                                               |
| ------------------ | ---------- | --------------- | --------------- | --------------------------------------------------- |
| "allreduce"        | dense      | Allreduce       | allreduce.py    | dense baseline (Horovod allreduce)                  |
| "hierarchical"     | 2dtar      | Hierarchical    | hierarchical.py | 2DTAR, shi2021 sec. 5.3                             |
| "sparse_allgather" | naiveag    | SparseAllgather | naiveag.py      | NaiveAG: MSTopK + global all-gather, shi2021 eq. 3  |
| "hitopk"           | hitopkcomm | HiTopK          | hitopk.py       | HiTopKComm, shi2021 Algorithm 2                     |
| "powersgd"         |            | PowerSGD        | powersgd.py     | PowerSGD, Vogels et al. 2019 Algorithms 1-2         |
| "lowbit"           | int8       | LowBit          | lowbit.py       | 8/4-bit with a scale per chunk + error feedback     |

What selects (MSTopK, `hvdx.ops`), what remembers (`memory.ResidualMemory`) and what
communicates (the strategies, with `wire` packing) are separate pieces. A strategy module
registers its class (`@register("name", aliases=...)`, `hvdx.comm.registry`); every module
of this package is imported here, so a new strategy is one new module (and its test). A
strategy decides its default aids for the optimizer it serves from the optimizer's
`OptimizerTraits` (`traits.py`, `Strategy.defaults_for`); `choice.py` resolves a wrapper's
strategy, options and traits once.
"""
from __future__ import annotations

import importlib
import pkgutil

from hvdx.comm.base import Aggregated, Strategy, get
from hvdx.comm.allreduce import Allreduce
from hvdx.comm.hierarchical import Hierarchical
from hvdx.comm.hitopk import HiTopK
from hvdx.comm.lowbit import LowBit
from hvdx.comm.memory import ResidualMemory
from hvdx.comm.naiveag import SparseAllgather
from hvdx.comm.powersgd import PowerSGD
from hvdx.comm.registry import is_name, names, register, resolve_name, strategy_class
from hvdx.comm.sparse import DEFAULT_DENSITY, TopKStrategy
from hvdx.comm.traits import OptimizerTraits, traits_of

__all__ = ["Aggregated", "Allreduce", "DEFAULT_DENSITY", "Hierarchical", "HiTopK", "LowBit", "OptimizerTraits",
           "PowerSGD", "ResidualMemory", "SparseAllgather", "Strategy", "TopKStrategy", "get", "is_name", "names",
           "register", "resolve_name", "strategy_class", "traits_of"]

for _module in pkgutil.iter_modules(__path__):  # each strategy module registers itself on import
    importlib.import_module(f"{__name__}.{_module.name}")
