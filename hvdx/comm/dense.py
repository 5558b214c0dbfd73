"""The former module of the dense strategies, kept so that users' imports keep working:
`Allreduce` is in `hvdx.comm.allreduce`, 2DTAR (`Hierarchical`) in `hvdx.comm.hierarchical`."""
from hvdx.comm.allreduce import OP_NAMES, Allreduce
from hvdx.comm.hierarchical import DEFAULT_FLAT_BELOW, Hierarchical

__all__ = ["Allreduce", "DEFAULT_FLAT_BELOW", "Hierarchical", "OP_NAMES"]
