"""Each rank of a job on the emulated cluster (hvdx/runner/cluster.py) checks where it runs.

Besides hvdx's topology checks of check_topology.py: the rank runs inside its node's
network namespace (eth0 has the node's address), got horovodrun's environment and the
cluster description, and its node's peers are the ranks sharing that namespace.
"""
import argparse
import json
import os
import socket

import psutil

from tests.multirank.check_topology import check
from tests.multirank.rank import run


def check_cluster(nodes: int, per_node: int) -> dict:
    seen = check(nodes, per_node)
    rank = int(os.environ["HOROVOD_RANK"])
    node = rank // per_node
    addresses = [a.address for a in psutil.net_if_addrs().get("eth0", []) if a.family == socket.AF_INET]
    assert addresses == [f"10.77.0.{node + 1}"], addresses
    assert os.environ["HOROVOD_HOSTNAME"] == f"node{node}", os.environ["HOROVOD_HOSTNAME"]
    assert os.environ["HOROVOD_GLOO_IFACE"] == "eth0"
    # This machine's host name is the node's own address inside the namespace (Gloo's
    # process-set devices are created from it).
    assert socket.gethostbyname(socket.gethostname()) == f"10.77.0.{node + 1}"
    description = json.loads(os.environ["HVDX_CLUSTER"])
    assert (description["nodes"], description["ranks_per_node"]) == (nodes, per_node), description
    print(f"rank {rank} on node{node} at {addresses[0]}", flush=True)
    return dict(seen, address=addresses[0], cluster=description)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--ranks-per-node", type=int, required=True)
    args = parser.parse_args()
    run(lambda: check_cluster(args.nodes, args.ranks_per_node))
