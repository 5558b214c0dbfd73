"""The two-level topology of a run: nodes, the ranks inside a node, and their process sets.

`hvdx.init()` wraps `hvd.init()` and builds, from Horovod's own `local_rank` / `local_size`:

- the node-local set: the ranks of one node (fast links; reduce-scatter and all-gather of
  HiTopKComm and 2DTAR, shi2021 Alg. 2 lines 1 and 10; DASO's node-local averaging);
- the cross set of each local rank l: rank l of every node (slow links; the inter-node
  all-gather of Alg. 2 line 8, one concurrent stream per local rank; DASO's groups).

Nodes must be homogeneous (the same number of ranks on each): otherwise `init()` raises
`TopologyError` on every rank, saying how to launch. A set equal to the whole world is
Horovod's global process set, which Horovod would not let us add twice. `topology()`
before `init()` raises RuntimeError. Importing this module imports neither TensorFlow nor
Horovod (`import hvdx` stays light); `init()` and the collectives do.
"""
from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

from . import mpi_defaults

if TYPE_CHECKING:
    import horovod.tensorflow as hvd

__all__ = ["Topology", "TopologyError", "barrier", "init", "initialized", "reinit", "set_rank_and_size", "shutdown",
           "topology"]


class TopologyError(RuntimeError):
    """The ranks do not form a topology hvdx supports (e.g. nodes of different sizes)."""


@dataclass(frozen=True)
class Topology:
    """This rank's place in an m-node x n-rank job (m = num_nodes, n = local_size)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    node_ranks: Tuple[Tuple[int, ...], ...]
    """Global ranks of every node, by node index, each ordered by local rank."""
    local_set: hvd.ProcessSet
    cross_set: hvd.ProcessSet

    @property
    def local_ranks(self) -> Tuple[int, ...]:
        """Global ranks of this rank's node, ordered by local rank."""
        return self.node_ranks[self.node]

    @property
    def cross_ranks(self) -> Tuple[int, ...]:
        """Global ranks with this rank's local rank, ordered by node."""
        return tuple(ranks[self.local_rank] for ranks in self.node_ranks)

    @property
    def two_tier(self) -> bool:
        """Whether the job has several nodes of several ranks: the case where a hierarchical
        strategy (a node-local exchange, then one across nodes) has two tiers to use."""
        return self.num_nodes > 1 and self.local_size > 1

    def __str__(self) -> str:
        return (f"rank {self.rank}/{self.size}: node {self.node}/{self.num_nodes}, "
                f"local rank {self.local_rank}/{self.local_size}, "
                f"local set {list(self.local_ranks)}, cross set {list(self.cross_ranks)}")


_topology: Optional[Topology] = None
_stall_timeout: Optional[float] = None  # the bound hvdx.init() was given, kept for reinit()
_uneven_nodes: Optional[str] = None  # the uneven_nodes hvdx.init() was given, kept for reinit()


def _node_key() -> str:
    """What Horovod groups a node by: the launcher's host name under horovodrun (Gloo),
    else this machine's name (MPI groups by shared memory, i.e. by machine)."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


#: What `init()` does with nodes of different sizes: "error" (TopologyError) or "flat" (every
#: rank taken as a node of its own, with one warning); $HVDX_UNEVEN_NODES, else "flat" in an
#: elastic job (Horovod's $HOROVOD_ELASTIC=1: a node that lost a rank must not stop it), else "error".
UNEVEN_NODES_ENV = "HVDX_UNEVEN_NODES"


#: How long a Gloo rendezvous waits for its peers in an elastic job (hvdx's Horovod patch 0003:
#: apart from the collectives' $HOROVOD_GLOO_TIMEOUT_SECONDS, so a short collective timeout
#: detects a dead node sooner while a reset still waits for an added host's new processes).
RENDEZVOUS_TIMEOUT_ENV = "HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS"
ELASTIC_RENDEZVOUS_TIMEOUT = 120


def elastic_job() -> bool:
    """Whether this process runs in an Elastic Horovod job (`horovodrun --min-np/--max-np/
    --host-discovery-script` sets $HOROVOD_ELASTIC=1)."""
    return os.environ.get("HOROVOD_ELASTIC", "0").strip() == "1"


def elastic_defaults() -> None:
    """In an elastic job, $HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS = `ELASTIC_RENDEZVOUS_TIMEOUT`
    unless set (Horovod reads it at every initialisation, the elastic resets' too)."""
    if elastic_job():
        os.environ.setdefault(RENDEZVOUS_TIMEOUT_ENV, str(ELASTIC_RENDEZVOUS_TIMEOUT))


def _resolve_uneven(uneven_nodes: Optional[str]) -> str:
    value = uneven_nodes if uneven_nodes is not None else os.environ.get(UNEVEN_NODES_ENV, "").strip()
    if not value:
        value = "flat" if elastic_job() else "error"
    if value not in ("error", "flat"):
        raise ValueError(f"uneven_nodes (or ${UNEVEN_NODES_ENV}) is 'error' or 'flat', got {value!r}")
    return value


def _group_nodes(entries: Sequence[Tuple[int, int, int, str]], uneven: str = "error"
                 ) -> Tuple[Tuple[int, ...], ...]:
    """Global ranks of each node, ordered by local rank; nodes ordered by their lowest rank.

    `entries` holds (rank, local_rank, local_size, node key) of every rank. Nodes of
    different sizes: with `uneven` "flat", one node per rank (the strategies' node steps
    become no-ops: flat over all ranks); with "error", TopologyError. Raises TopologyError,
    with the same text on every rank, if the keys disagree with Horovod's local ranks.
    """
    by_key: dict = {}
    for rank, local_rank, local_size, key in sorted(entries):
        by_key.setdefault(key, []).append((local_rank, rank, local_size))
    nodes = sorted(by_key.items(), key=lambda item: min(r for _, r, _ in item[1]))
    sizes = {len(members) for _, members in nodes}
    if len(sizes) > 1:
        layout = _layout(entries)
        if uneven == "flat":
            return tuple((rank,) for rank, _, _, _ in sorted(entries))
        raise TopologyError(
            "hvdx needs homogeneous nodes (the same number of ranks on every node), got "
            f"{layout}. Launch as many processes on every host, e.g. "
            "`horovodrun -np 4 -H host1:2,host2:2`, or run flat over all ranks with "
            f"hvdx.init(uneven_nodes='flat') / ${UNEVEN_NODES_ENV}=flat (the default in an elastic job).")
    node_ranks = []
    for key, members in nodes:
        local_ranks = sorted(lr for lr, _, _ in members)
        if local_ranks != list(range(len(members))) or any(ls != len(members) for _, _, ls in members):
            raise TopologyError(
                f"Horovod's local ranks on node {key!r} are {local_ranks} with local sizes "
                f"{sorted({ls for _, _, ls in members})}, but {len(members)} rank(s) run there: "
                "the launcher's host names do not match Horovod's view of the nodes.")
        ranks = tuple(r for _, r, _ in sorted(members))
        if list(ranks) != sorted(ranks):
            # Horovod orders a process set by global rank; slices of a node's buffer are
            # owned by set rank, and cross sets group equal local ranks: the two must agree.
            raise TopologyError(f"local ranks on node {key!r} do not follow global rank order: {ranks}")
        node_ranks.append(ranks)
    return tuple(node_ranks)


def _layout(entries: Sequence[Tuple[int, int, int, str]]) -> str:
    """"node: n rank(s) [ranks]" per node, nodes by their lowest rank."""
    by_key: dict = {}
    for rank, _, _, key in sorted(entries):
        by_key.setdefault(key, []).append(rank)
    return ", ".join(f"{key}: {len(r)} rank(s) {r}" for key, r in sorted(by_key.items(), key=lambda i: min(i[1])))


def _horovod() -> Any:
    """`horovod.tensorflow`, imported on first use (it imports TensorFlow)."""
    import horovod.tensorflow as hvd

    return hvd


def _process_set(ranks: Sequence[int], world: int) -> "hvd.ProcessSet":
    hvd = _horovod()
    if len(ranks) == world:
        return hvd.global_process_set
    return hvd.add_process_set(sorted(ranks))


def init(comm: Optional[Sequence[int]] = None, stall_timeout: Optional[float] = None,
         uneven_nodes: Optional[str] = None) -> Topology:
    """Initializes Horovod (with dynamic process sets) and hvdx's topology; idempotent.

    Collective: every rank must call it. Returns this rank's `Topology`.

    In a job of two or more ranks it starts the progress watchdog (`hvdx.watchdog`): a rank
    that waits in one of hvdx's collective calls for longer than `stall_timeout` seconds
    without progress makes every rank report which ranks reached which call, and the job end
    with a non-zero code. None: $HVDX_STALL_TIMEOUT_SECONDS, else 300 s; 0: off
    (docs/comm.md, "The progress watchdog"). A bad value raises ValueError.

    Under an MPI launcher on a machine with more ranks than cores, Open MPI is first told to
    yield the core while it waits (`hvdx.mpi_defaults.apply_mpi_defaults`; `HVDX_MPI_DEFAULTS=0`
    leaves the environment alone); where that could not take effect (MPI already initialized,
    or emulated nodes sharing one machine), rank 0 warns with the flags to pass instead
    (`hvdx.mpi_defaults.oversubscription_warning`, a RuntimeWarning).

    Nodes of different sizes (`uneven_nodes`): "error" raises TopologyError; "flat" takes
    every rank as a node of its own (hierarchical strategies run flat over all ranks; rank 0
    warns once) until a later init (Elastic Horovod's reset) finds even nodes again. None:
    $HVDX_UNEVEN_NODES, else "flat" in an elastic job ($HOROVOD_ELASTIC=1), else "error".
    In an elastic job it also sets $HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS to 120 unless set
    (`RENDEZVOUS_TIMEOUT_ENV`: a reset waits that long for an added host's processes, however
    short the collectives' $HOROVOD_GLOO_TIMEOUT_SECONDS).

    Uses no Keras: it works where tf.keras is Keras 3 too (docs/keras3.md). Raises
    TopologyError for nodes of different sizes under "error", ValueError for a bad option.
    """
    global _topology, _stall_timeout, _uneven_nodes
    if _topology is not None:
        return _topology
    from hvdx import watchdog

    bound = watchdog.resolve_timeout(stall_timeout)
    uneven = _resolve_uneven(uneven_nodes)
    _stall_timeout, _uneven_nodes = stall_timeout, uneven_nodes
    hvd = _horovod()
    elastic_defaults()
    if not hvd.is_initialized():
        mpi_defaults.apply_mpi_defaults()
        hvd.init(comm=comm, process_sets="dynamic")
    rank, size = hvd.rank(), hvd.size()
    dog, address = (watchdog.Watchdog(bound) if bound > 0 and size > 1 else None), None
    if dog is not None:
        try:
            address = dog.listen()
        except (OSError, RuntimeError) as exc:  # TransportError: a bad $HOROVOD_GLOO_IFACE / $HVDX_TRANSPORT_IFACE
            warnings.warn(f"hvdx's progress watchdog is off on rank {rank}: it cannot listen ({exc}). Set "
                          f"${watchdog.ENV}=0 to silence this, or fix the interface.", RuntimeWarning, stacklevel=2)
            dog = None
    entries = hvd.allgather_object((rank, hvd.local_rank(), hvd.local_size(), _node_key(),
                                    mpi_defaults.machine_facts(), address), name="hvdx.topology")
    message = mpi_defaults.oversubscription_warning([e[4] for e in entries], mpi=hvd.mpi_enabled())
    if message and rank == 0:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    node_ranks = _group_nodes([e[:4] for e in entries], uneven)
    if len(node_ranks) == size and size > 1 and len({e[3] for e in entries}) < size and rank == 0:
        warnings.warn(f"hvdx: the nodes have different numbers of ranks "
                      f"({_layout([e[:4] for e in entries])}); every rank runs as a node of its own (flat "
                      "over all ranks: HiTopK and 2DTAR without their node-local steps) until the nodes are "
                      "even again (uneven_nodes='flat')", RuntimeWarning, stacklevel=2)
    local_size = len(node_ranks[0])
    node = next(i for i, ranks in enumerate(node_ranks) if rank in ranks)
    sets = {}
    try:
        # Every rank adds every set, in the same order: adding a process set is collective.
        for i, ranks in enumerate(node_ranks):
            sets["local", i] = _process_set(ranks, size)
        for lr in range(local_size):
            sets["cross", lr] = _process_set([ranks[lr] for ranks in node_ranks], size)
    except (ValueError, NotImplementedError, RuntimeError) as exc:
        raise TopologyError(
            "hvdx could not add its process sets to Horovod. Call hvdx.init() instead of "
            "hvd.init(), or initialize Horovod with hvd.init(process_sets='dynamic') and "
            f"without the node-local or cross-node sets already added ({exc})") from exc
    local_rank = node_ranks[node].index(rank)
    _topology = Topology(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                         node=node, num_nodes=len(node_ranks), node_ranks=node_ranks,
                         local_set=sets["local", node], cross_set=sets["cross", local_rank])
    if dog is not None:
        dog.start(rank, size, [e[5] for e in entries])
    from hvdx import timeline

    timeline.start(rank)  # hvdx's spans in Horovod's timeline, when that is on
    return _topology


def reinit() -> Topology:
    """After Horovod re-initialised under new membership (Elastic Horovod's reset: shutdown,
    then init on the new ranks): forgets the old topology and its process sets and builds
    them again for the new ranks (`init()`: nodes re-detected, a set equal to the whole
    world is Horovod's global set). Collective over the new ranks. Returns the new
    `Topology`; strategies read it at their next trace (`hvdx.comm.base.Strategy.topology`).

    Raises RuntimeError if Horovod is not initialised (call it after Horovod's reset), and
    TopologyError as `init()` does.

    The progress watchdog of the old membership stops (its peers are gone), the progress
    counts restart (a call abandoned by the failed step is not waited in), and a new watchdog
    starts with the new ranks under the bound `init()` was given.
    """
    if not _horovod().is_initialized():
        raise RuntimeError("hvdx.topology.reinit() rebuilds hvdx's topology after Horovod re-initialised; "
                           "Horovod is not initialised: call hvd.init() (or hvdx.init()) first")
    _forget_membership()
    return init(stall_timeout=_stall_timeout, uneven_nodes=_uneven_nodes)


def _forget_membership() -> None:
    """Forgets the job's membership (before a new one): its watchdog stops (its peers are
    gone), the progress counts restart on every rank (a call abandoned by a failed step is not
    waited in), and the topology is dropped."""
    global _topology
    from hvdx import progress, watchdog

    if watchdog.current() is not None:
        watchdog.current().stop()
    if progress.enabled():
        progress.rebase()
    _topology = None


def initialized() -> bool:
    """Whether hvdx.init() has run in this process."""
    return _topology is not None


def topology() -> Topology:
    """This rank's `Topology`; raises if `hvdx.init()` has not been called."""
    if _topology is None:
        raise RuntimeError("hvdx.topology() needs hvdx.init() first")
    return _topology


def set_rank_and_size(process_set: Optional["hvd.ProcessSet"] = None) -> Tuple[int, int]:
    """(this rank's index in `process_set`, the set's size); None or Horovod's global set:
    all ranks; (0, 1) without Horovod."""
    hvd = _horovod()
    if not hvd.is_initialized():
        return 0, 1
    if process_set is None or process_set is hvd.global_process_set:
        return hvd.rank(), hvd.size()
    return process_set.rank(), process_set.size()


def barrier(process_set: Optional["hvd.ProcessSet"] = None) -> None:
    """Blocks until every rank of `process_set` (None: Horovod's global set) arrives (a
    one-element allreduce).

    End multi-rank scripts with it: a rank that exits while others still communicate
    shuts Horovod down under them.
    """
    import tensorflow as tf

    hvd = _horovod()
    hvd.allreduce(tf.zeros([1], tf.int32), op=hvd.Sum, name="hvdx.barrier",
                  process_set=hvd.global_process_set if process_set is None else process_set)


def shutdown() -> None:
    """Shuts Horovod down and forgets the topology (hvdx.init() may be called again)."""
    from hvdx import timeline

    _forget_membership()  # a later hvdx.init() is a new membership
    _horovod().shutdown()
    timeline.write()  # after Horovod's timeline closed
