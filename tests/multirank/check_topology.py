"""Each rank checks its own view of an m-node x n-rank job (tests/test_topology.py).

horovodrun places ranks host by host, so rank r runs on node r // n as local rank r % n.
On nodes of different sizes, every rank must instead get hvdx's TopologyError ("heterogeneous").
"""
import importlib

import horovod.tensorflow as hvd
import tensorflow as tf

import hvdx


def check(nodes: int = 1, per_node: int = 1) -> dict:
    topo = hvdx.init()
    rank = topo.rank
    node, local_rank = divmod(rank, per_node)
    assert (topo.size, topo.num_nodes, topo.local_size) == (nodes * per_node, nodes, per_node), topo
    assert (topo.node, topo.local_rank) == (node, local_rank), topo
    assert (topo.rank, topo.local_rank) == (hvd.rank(), hvd.local_rank()), topo
    assert (topo.num_nodes, topo.node) == (hvd.cross_size(), hvd.cross_rank()), topo
    node_ranks = tuple(tuple(range(j * per_node, (j + 1) * per_node)) for j in range(nodes))
    assert topo.node_ranks == node_ranks, topo.node_ranks
    local_members = list(node_ranks[node])
    cross_members = [j * per_node + local_rank for j in range(nodes)]
    assert list(topo.local_ranks) == local_members and list(topo.cross_ranks) == cross_members, topo
    assert topo.local_set.ranks == local_members, topo.local_set
    assert topo.cross_set.ranks == cross_members, topo.cross_set
    world = list(range(topo.size))
    for pset, members in ((topo.local_set, local_members), (topo.cross_set, cross_members)):
        # A set equal to the world must be Horovod's global set, never a duplicate of it.
        assert (pset is hvd.global_process_set) == (members == world), (pset, members)
        assert pset.included() and pset.size() == len(members) and pset.rank() == members.index(rank)
    # The sets work: sums over them see exactly their members.
    local_sum = hvd.allreduce(tf.constant(rank), op=hvd.Sum, process_set=topo.local_set, name="local")
    cross_sum = hvd.allreduce(tf.constant(rank), op=hvd.Sum, process_set=topo.cross_set, name="cross")
    assert int(local_sum) == sum(local_members), (int(local_sum), local_members)
    assert int(cross_sum) == sum(cross_members), (int(cross_sum), cross_members)
    assert hvdx.init() is topo and hvdx.topology() is topo  # idempotent
    return {"topology": str(topo)}


def expect_heterogeneous() -> dict:
    try:
        hvdx.init()
    except hvdx.TopologyError as exc:
        return {"error": str(exc)}
    raise AssertionError("hvdx.init() accepted nodes of different sizes")


def uneven_flat() -> dict:
    """After the error (same launch): hvdx.init(uneven_nodes="flat") takes every rank as a node
    of its own, warns on rank 0, and HiTopK and 2DTAR average over all ranks."""
    import warnings

    import numpy as np

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        topo = hvdx.init(uneven_nodes="flat")
    rank, size = topo.rank, topo.size
    assert (topo.num_nodes, topo.local_size, topo.node_ranks) == (size, 1, tuple((r,) for r in range(size))), topo
    assert topo.cross_set is hvd.global_process_set
    warned = [str(w.message) for w in caught if "different numbers of ranks" in str(w.message)]
    assert len(warned) == (rank == 0), warned
    x = tf.constant(np.arange(12, dtype=np.float32) * (rank + 1))
    mean = np.arange(12, dtype=np.float32) * np.mean(np.arange(1, size + 1))
    out = {}
    for name, options in (("hierarchical", {}), ("hitopk", {"density": 1.0})):
        got = hvdx.comm.get(name, **options)(x, f"uneven.{name}").numpy()
        assert np.allclose(got, mean), (name, got, mean)
        out[name] = got.tolist()
    hvdx.barrier()
    importlib.import_module("hvdx.topology")._forget_membership()  # a later check's hvdx.init() looks again
    return {"warned": warned, **out}


CHECKS = {"check": check, "heterogeneous": expect_heterogeneous, "uneven_flat": uneven_flat}
