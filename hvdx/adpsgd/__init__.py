"""AD-PSGD (lian2018: Lian, Zhang, Zhang, Liu, "Asynchronous Decentralized Parallel Stochastic
Gradient Descent", ICML 2018, arXiv 1710.06952): every rank keeps its own model, computes
gradients on it and, concurrently, averages it with one random neighbour at a time; nobody
waits for everybody.

- `hvdx.adpsgd.graph`: who gossips with whom (ring, the paper's 2^i + 1 hops; bipartite:
  active ranks start exchanges, passive ones answer, sec. 3.1);
- `hvdx.adpsgd.gossip`: Algorithm 1 on one rank's flat model, the averaging on the
  transport's threads (`hvdx.transport.peer`), the averages over all ranks;
- `hvdx.adpsgd.method`: `ADPSGD` on TensorFlow variables, an `hvdx.lifecycle.TrainingMethod`
  (custom loops, or `Model.fit` through `hvdx.callbacks.TrainingMethodCallback`);
- `hvdx.adpsgd.keras`: `ADPSGDCallback`, which builds one per `fit` (reached here without
  importing Keras' callbacks until asked for).

Guide: docs/adpsgd.md.
"""
from hvdx.adpsgd.gossip import Gossip
from hvdx.adpsgd.graph import TOPOLOGIES, Graph, build_graph, register_topology
from hvdx.adpsgd.method import ADPSGD

__all__ = ["ADPSGD", "ADPSGDCallback", "Gossip", "Graph", "TOPOLOGIES", "build_graph",
           "register_topology"]


def __getattr__(name: str):
    if name == "ADPSGDCallback":  # its Keras glue (hvdx.adpsgd.keras), imported when asked for
        from hvdx.adpsgd.keras import ADPSGDCallback
        return ADPSGDCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
