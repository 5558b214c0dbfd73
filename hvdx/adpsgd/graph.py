"""Who gossips with whom: AD-PSGD's communication graphs (lian2018 sec. 3.1 and 3.2: Lian,
Zhang, Zhang, Liu, "Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML
2018, arXiv 1710.06952).

A graph must be connected (else the models never reach consensus) and bipartite: its ranks
split into an active set, whose members start every exchange, and a passive set, whose
members only answer, and every edge joins an active rank to a passive one (sec. 3.1). An
active rank waits only on a passive one, a passive one on nobody, so no cycle of waits, and
no deadlock, can form. `build_graph` 2-colours the graph (rank 0 active) and refuses one that
is not bipartite or not connected.

Topologies (a name -> a function n -> edges; `register_topology` adds one):

- `"ring"`: rank r and r + 1 (mod n). For odd n the ring is an odd cycle, not bipartite: the
  edge (n - 1, 0) is dropped, leaving a path.
- `"exponential"` (the paper's "2^i + 1 hops", sec. 3.2): rank r and r + h (mod n) for the hop
  lengths h = 1 and h = 2^i + 1 < n, i >= 1, so any two ranks are O(log n) hops apart. The
  paper's i = 0 gives h = 2, which joins two ranks of the same parity and breaks the
  active/passive split: hvdx uses the ring's h = 1 in its place. For odd n, edges that close
  an odd cycle through the wrap-around (same parity at both ends) are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Sequence, Set, Tuple

from hvdx.arguments import integer

__all__ = ["Graph", "TOPOLOGIES", "build_graph", "register_topology"]

Edges = Iterable[Tuple[int, int]]
TOPOLOGIES: Dict[str, Callable[[int], Edges]] = {}


def register_topology(name: str) -> Callable[[Callable[[int], Edges]], Callable[[int], Edges]]:
    """Decorator: `@register_topology("mine") def mine(n): return [(a, b), ...]`."""
    def add(fn: Callable[[int], Edges]) -> Callable[[int], Edges]:
        TOPOLOGIES[name] = fn
        return fn
    return add


def _parity_edges(n: int, hops: Sequence[int]) -> List[Tuple[int, int]]:
    edges = set()
    for r in range(n):
        for h in hops:
            s = (r + h) % n
            if s != r and (r % 2) != (s % 2):
                edges.add((min(r, s), max(r, s)))
    return sorted(edges)


@register_topology("ring")
def ring(n: int) -> List[Tuple[int, int]]:
    """Rank r and r + 1 (mod n); the wrap-around edge dropped for odd n (sec. 3.2)."""
    return _parity_edges(n, [1])


@register_topology("exponential")
def exponential(n: int) -> List[Tuple[int, int]]:
    """Hops 1 and 2^i + 1 < n (i >= 1) around the ring (sec. 3.2; see the module docstring)."""
    hops = [1]
    i = 1
    while 2 ** i + 1 < n:
        hops.append(2 ** i + 1)
        i += 1
    return _parity_edges(n, hops)


@dataclass(frozen=True)
class Graph:
    """A connected bipartite graph on ranks 0..size-1; `active` starts the exchanges."""
    size: int
    edges: Tuple[Tuple[int, int], ...]
    active: FrozenSet[int]
    name: str = ""

    def neighbours(self, rank: int) -> Tuple[int, ...]:
        return tuple(sorted({b for a, b in self.edges if a == rank} | {a for a, b in self.edges if b == rank}))

    def is_active(self, rank: int) -> bool:
        return rank in self.active

    def mixing_matrix(self, a: int, b: int) -> "list[list[float]]":
        """W of one exchange between a and b (lian2018 eq. 2): I - (e_a - e_b)(e_a - e_b)^T / 2,
        symmetric and doubly stochastic."""
        w = [[float(i == j) for j in range(self.size)] for i in range(self.size)]
        w[a][a] = w[b][b] = w[a][b] = w[b][a] = 0.5
        return w


def build_graph(topology: "str | Callable[[int], Edges]", size: int) -> Graph:
    """The graph of `topology` (a registered name or a function n -> edges) on `size` ranks.

    Raises ValueError: an unknown name (listing the known ones), fewer than 2 ranks, an edge
    outside 0..size-1 or a self-loop, a graph that is not connected or not bipartite.
    """
    size = integer(size, "size")
    if size < 2:
        raise ValueError(f"AD-PSGD needs at least 2 ranks to gossip, this job has {size}: launch it with "
                         f"horovodrun -np 2 or more, or train without hvdx.adpsgd")
    if isinstance(topology, str):
        if topology not in TOPOLOGIES:
            raise ValueError(f"unknown AD-PSGD topology {topology!r}: choose one of {sorted(TOPOLOGIES)} "
                             f"or pass a function n -> [(rank, rank), ...]")
        name, fn = topology, TOPOLOGIES[topology]
    elif callable(topology):
        name, fn = getattr(topology, "__name__", "custom"), topology
    else:
        raise ValueError(f"topology must be a name {sorted(TOPOLOGIES)} or a function, got {topology!r}")
    edges = set()
    for edge in fn(size):
        a, b = (int(v) for v in edge)
        if not (0 <= a < size and 0 <= b < size) or a == b:
            raise ValueError(f"topology {name!r} gives edge {edge!r}, not two distinct ranks of 0..{size - 1}")
        edges.add((min(a, b), max(a, b)))
    adjacency: Dict[int, Set[int]] = {r: set() for r in range(size)}
    for a, b in edges:
        adjacency[a].add(b)
        adjacency[b].add(a)
    colour = {0: 0}
    frontier = [0]
    while frontier:
        r = frontier.pop()
        for s in adjacency[r]:
            if s not in colour:
                colour[s] = 1 - colour[r]
                frontier.append(s)
            elif colour[s] == colour[r]:
                raise ValueError(f"topology {name!r} on {size} ranks is not bipartite (ranks {r} and {s} are "
                                 f"neighbours on the same side): AD-PSGD's deadlock-free split into active and "
                                 f"passive ranks needs a bipartite graph (lian2018 sec. 3.1)")
    if len(colour) != size:
        raise ValueError(f"topology {name!r} on {size} ranks is not connected (ranks "
                         f"{sorted(set(range(size)) - set(colour))} are cut off from rank 0)")
    return Graph(size, tuple(sorted(edges)), frozenset(r for r, c in colour.items() if c == 0), name)
