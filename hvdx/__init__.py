"""hvdx: Horovod + TensorFlow extensions for clusters whose nodes are well connected inside
and poorly connected between each other.

    import hvdx
    topo = hvdx.init()          # hvd.init() + node-local and cross-node process sets
    print(topo)                 # rank, node, local rank, and the members of both sets
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="hitopk")
    opt = hvdx.DASO(tf.keras.optimizers.SGD(0.1), total_epochs=20)   # + hvdx.daso.DASOCallback()
    model.fit(..., callbacks=[hvdx.adpsgd.ADPSGDCallback(topology="exponential")])   # AD-PSGD

`hvdx.keras` and `hvdx.tensorflow` are Horovod's APIs with hvdx's optimizer and tape.
"""
from hvdx import adpsgd, asynchronous, buckets, callbacks, comm, daso, data, localsgd, ops, optimizers, pto, transport
from hvdx.aggregator import GradientAggregator
from hvdx.daso import DASO
from hvdx.layout import RankMismatchError
from hvdx.loading import load_model
from hvdx.ops import mstopk, sparse_accumulate
from hvdx.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from hvdx.tape import DistributedGradientTape
from hvdx.topology import Topology, TopologyError, barrier, init, shutdown, topology

__version__ = "0.2.0"

__all__ = ["DASO", "DistributedGradientTape", "DistributedOptimizer", "GradientAggregator", "PartialDistributedOptimizer",
           "RankMismatchError", "Topology", "TopologyError", "adpsgd", "asynchronous", "barrier", "buckets", "callbacks", "comm", "daso", "data", "init",
           "load_model", "localsgd", "mstopk", "ops", "optimizers", "pto", "shutdown", "sparse_accumulate", "topology", "transport"]
