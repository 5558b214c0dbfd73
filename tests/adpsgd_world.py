"""In-process AD-PSGD worlds for tests/test_adpsgd.py: one Gossip per rank, each on its own
threads, the address exchange passed in (no Horovod), and a file-based exchange for worlds
of separate processes (tests/adpsgd_worker.py)."""
import json
import os
import pathlib
import time
from typing import Callable, List, Optional

import numpy as np

from hvdx.adpsgd.gossip import Gossip
from hvdx.adpsgd.graph import build_graph
from hvdx.transport.peer import PeerTransport
from hvdx.transport.ring import GroupTransport
from tests import harness


def thread_allgather(world: int) -> Callable[[int], Callable]:
    """allgather(obj) for `world` threads of this process, by rank; obj[0] is the caller's rank."""
    allgather = harness.thread_allgather(world, timeout=60)
    return lambda rank: allgather


def file_allgather(directory: str, rank: int, world: int, timeout: float = 60.0) -> Callable:
    """allgather(obj) through files in `directory` (a fresh name per call), for processes."""
    calls = [0]

    def allgather(obj):
        calls[0] += 1
        base = pathlib.Path(directory)
        (base / f"{calls[0]}.{rank}.tmp").write_text(json.dumps(obj))
        os.replace(base / f"{calls[0]}.{rank}.tmp", base / f"{calls[0]}.{rank}.json")
        deadline = time.monotonic() + timeout
        out = []
        for r in range(world):
            path = base / f"{calls[0]}.{r}.json"
            while not path.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} did not publish its address")
                time.sleep(0.02)
            out.append(json.loads(path.read_text()))
        return [_tuples(entry) for entry in out]
    return allgather


def _tuples(obj):
    """JSON's lists back to the tuples that were published."""
    return tuple(_tuples(x) for x in obj) if isinstance(obj, list) else obj


def make_gossip(model: np.ndarray, rank: int, world: int, topology: str, allgather: Callable,
                timeout: float = 30.0, finish_timeout: Optional[float] = None, **options) -> Gossip:
    """One rank's Gossip; `options` go to Gossip (switch_interval, step_budget, seed)."""
    graph = build_graph(topology, world)
    peers = PeerTransport._create(list(graph.neighbours(rank)), rank, "test.peers", timeout, world, allgather)
    ring = GroupTransport._create([list(range(world))], rank, "test.ring", max(timeout, finish_timeout or 0),
                                  world, allgather)
    return Gossip(model, graph, rank, peers, ring, timeout=timeout, finish_timeout=finish_timeout, **options)


def build_world(models: List[np.ndarray], topology: str = "ring", timeout: float = 30.0, **options) -> List[Gossip]:
    """One Gossip per model (rank = index), built concurrently on threads; `options` go to Gossip."""
    world = len(models)
    gather = thread_allgather(world)
    return harness.on_threads(lambda rank: make_gossip(models[rank], rank, world, topology, gather(rank), timeout,
                                                       **options), world, join_timeout=90)
