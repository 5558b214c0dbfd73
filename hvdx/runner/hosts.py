"""Host lists that emulate several nodes on one machine.

horovodrun treats `localhost`, `127.0.0.1` and this machine's host name as three nodes
(each is "local", so no ssh): `hosts(2, 2)` is a real 2-node x 2-rank topology for Horovod,
with node-local and cross-node ranks, over loopback.
"""
from __future__ import annotations

import socket
from typing import Sequence

#: The names horovodrun takes for distinct nodes of this one machine.
NODE_NAMES = ("localhost", "127.0.0.1", socket.gethostname())


def hosts(nodes: int, ranks_per_node: int) -> str:
    """A horovodrun -H value for `nodes` emulated nodes of `ranks_per_node` ranks each.

    Raises:
        ValueError: more nodes than NODE_NAMES can emulate.
    """
    return host_list([ranks_per_node] * nodes)


def host_list(ranks_per_node: Sequence[int]) -> str:
    """A horovodrun -H value with the given number of ranks on each emulated node, e.g.
    [1, 2] -> "localhost:1,127.0.0.1:2".

    Raises:
        ValueError: more nodes than NODE_NAMES can emulate (use the emulated cluster,
            hvdx/runner/cluster.py, for more), or a node without ranks.
    """
    if len(ranks_per_node) > len(NODE_NAMES):
        raise ValueError(f"at most {len(NODE_NAMES)} emulated nodes on one machine")
    if any(n < 1 for n in ranks_per_node):
        raise ValueError(f"every node needs at least one rank, got {list(ranks_per_node)}")
    return ",".join(f"{name}:{n}" for name, n in zip(NODE_NAMES, ranks_per_node))
