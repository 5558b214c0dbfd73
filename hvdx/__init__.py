"""hvdx: Horovod + TensorFlow extensions for clusters whose nodes are well connected inside
and poorly connected between each other.

    import hvdx
    topo = hvdx.init()          # hvd.init() + node-local and cross-node process sets
    print(topo)                 # rank, node, local rank, and the members of both sets
"""
from hvdx import callbacks, comm, ops
from hvdx.ops import mstopk, sparse_accumulate
from hvdx.optimizer import DistributedGradientTape, DistributedOptimizer
from hvdx.topology import Topology, TopologyError, barrier, init, shutdown, topology

__version__ = "0.1.0"

__all__ = ["DistributedGradientTape", "DistributedOptimizer", "Topology", "TopologyError", "barrier", "callbacks", "comm", "init", "mstopk", "ops", "shutdown", "sparse_accumulate", "topology"]
