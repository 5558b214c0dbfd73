"""The shared-memory engine of the node-local collectives (`node_engine="shm"` of 2DTAR and
HiTopK; `hvdx.node.collectives` dispatches to it).

2DTAR and HiTopKComm run an all-to-all (the node-local reduce-scatter) and all-gathers inside
each node. Through Horovod under Gloo those bytes cross TCP loopback; here they go through one
shared-memory segment per node, written and read by the node's ranks with two copies and a
futex barrier (csrc/kernels/node_shm.h has the layout and the protocol; the segment's header,
creation, attachment and removal are `hvdx.shm`'s, shared with the asynchronous methods).

Life of a segment (nothing is left in /dev/shm after any exit, SIGKILL included):

1. `communicator()` (collective over all ranks, once per process and topology): rank 0 draws a
   token and Horovod broadcasts it; the node's local rank 0 creates
   `/dev/shm/hvdx-node-<token>-<node>` (O_EXCL), writes the header and registers an atexit
   hook that unlinks it.
2. After a node barrier (a Horovod all-gather over the node's set, which also reports any
   rank's failure to every rank), the other ranks attach: map it, check magic, layout, number
   of ranks and slot size, record their pid at their local rank.
3. After a second node barrier, local rank 0 unlinks the name. From then on the memory lives
   as long as a rank maps it, and the kernel frees it when the last one exits. A creator killed
   between 1 and 3 leaves a name behind: the next `create` on the machine removes names whose
   creator pid no longer exists (`sweep`).

Order: the collectives of a channel (0: all-to-all, 1: all-gather) run on one worker thread
per process in the order their ops start, and in a graph (tf.function, Keras' train step) each
node collective is chained by a control dependency to the previous one of its channel in
creation order, which is the same on every rank (the aggregator builds buckets in one order).
Calls inside tf.cond / tf.while_loop branches are not chained with those outside: do not issue
them there. A rank that issues another collective than the others at the same call number
fails with an error naming both ranks and both collectives; a rank that dies or does not
arrive within the timeout (HVDX_NODE_SHM_TIMEOUT, 300 s) fails the others, naming it.

When it pays: Gloo on CPU tensors (TCP loopback inside the node). Under MPI (its own shared
memory transport) or NCCL it is allowed but rarely faster; GPU tensors are refused (they would
be copied through the host).
"""
from __future__ import annotations

import os
import struct
import weakref
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvdx import shm
from hvdx.shm import PAGE, SHM_DIR, align

__all__ = ["ALLGATHER", "ALLTOALL", "NodeCommunicator", "NodeShmError", "PREFIX", "SHM_DIR", "Segment",
           "communicator", "node_allgather", "node_alltoall", "sweep"]

PREFIX = "hvdx-node-"
MAGIC = b"HVDXNSM1"
#: 2: the common header of hvdx.shm (csrc/kernels/shm_segment.h) at the start.
LAYOUT_VERSION = 2
MAX_RANKS = 64
#: Channels of a segment: each an independent communicator with its own order.
ALLTOALL, ALLGATHER = 0, 1
CHANNELS = 2
#: Bytes of one rank's data slots per channel (HVDX_NODE_SHM_SLOT_BYTES), half in each of the
#: two alternating buffers; larger collectives run in chunks. A node of n ranks maps 2 n of them.
DEFAULT_SLOT_BYTES = 8 << 20
DEFAULT_TIMEOUT_S = 300.0
#: NodeHeader of csrc/kernels/node_shm.h after the common header (hvdx.shm.HEADER): num_ranks,
#: channels, slot_bytes, channel_offset, channel_stride, slots_offset; the local ranks' pids at
#: _PIDS; the channels from _CHANNEL_OFFSET.
_FIELDS = struct.Struct("<IIQQQQ")
_PIDS = 256
_CHANNEL_OFFSET = _PIDS + 4 * MAX_RANKS
_CHANNEL_HEADER, _RECORD = 256, 256
_DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.uint8, tf.int8, tf.int16,
           tf.uint16, tf.bool)


class NodeShmError(RuntimeError):
    """A node segment could not be created, attached or used."""


NODE = shm.Kind(prefix=PREFIX, magic=MAGIC, version=LAYOUT_VERSION, header_bytes=_CHANNEL_OFFSET, what="node segment",
                creator="the node's local rank 0", error=NodeShmError,
                full_hint=", or lower HVDX_NODE_SHM_SLOT_BYTES")


def _layout(num_ranks: int, slot_bytes: int) -> Tuple[int, int, int, int]:
    """(channel_offset, slots_offset, channel_stride, total bytes) of a segment."""
    slots_offset = align(_CHANNEL_HEADER + 64 * MAX_RANKS + 2 * _RECORD * num_ranks, PAGE)
    stride = align(slots_offset + slot_bytes * num_ranks, PAGE)
    return _CHANNEL_OFFSET, slots_offset, stride, align(_CHANNEL_OFFSET + CHANNELS * stride, PAGE)


def sweep(directory: Path = SHM_DIR) -> List[str]:
    """Removes node segments whose creator (pid in the header) no longer exists; returns their
    names. Only a creator killed before it unlinked leaves one."""
    return shm.sweep(NODE, directory)


class Segment(shm.Segment):
    """One node's mapped segment, as local rank `rank`. Build with `create` (local rank 0)
    or `attach`.

    Attributes (besides `hvdx.shm.Segment`'s): rank, num_ranks, slot_bytes."""

    kind = NODE
    rank: int = 0

    def _on_map(self) -> None:
        self.num_ranks, _, self.slot_bytes, *_ = _FIELDS.unpack_from(self._mmap, shm.HEADER_BYTES)

    def _pids(self) -> np.ndarray:
        return np.frombuffer(self._mmap, np.int32, MAX_RANKS, _PIDS)

    @classmethod
    def create(cls, name: str, num_ranks: int, slot_bytes: int = DEFAULT_SLOT_BYTES, *,
               directory: Path = SHM_DIR) -> "Segment":
        """Creates the segment `name` for `num_ranks` ranks (this process is local rank 0) and
        registers an atexit unlink. Raises ValueError for bad sizes, NodeShmError when the name
        exists or /dev/shm cannot hold it."""
        if not 1 <= num_ranks <= MAX_RANKS:
            raise ValueError(f"a node segment serves 1 to {MAX_RANKS} ranks, got {num_ranks}")
        if slot_bytes < PAGE or slot_bytes % PAGE:
            raise ValueError(f"slot_bytes must be a multiple of {PAGE} (HVDX_NODE_SHM_SLOT_BYTES), got {slot_bytes}")
        channel_offset, slots_offset, stride, total = _layout(num_ranks, slot_bytes)

        def write(mm) -> None:
            _FIELDS.pack_into(mm, shm.HEADER_BYTES, num_ranks, CHANNELS, slot_bytes, channel_offset, stride,
                              slots_offset)
            np.frombuffer(mm, np.int32, 1, _PIDS)[0] = os.getpid()  # local rank 0, counted in `attached`

        return cls._create(name, total, write, directory=directory)

    @classmethod
    def attach(cls, name: str, rank: int, num_ranks: int, slot_bytes: int = DEFAULT_SLOT_BYTES, *,
               directory: Path = SHM_DIR) -> "Segment":
        """Maps the segment `name` as local rank `rank` of `num_ranks` and records this
        process's pid. Raises NodeShmError when it is missing or its layout, number of ranks
        or slot size differ, or `rank` is taken by a live process."""

        def admit(segment: "Segment") -> None:
            if segment.num_ranks != num_ranks or segment.slot_bytes != slot_bytes:
                raise NodeShmError(f"{segment.path} serves {segment.num_ranks} ranks with {segment.slot_bytes}-byte "
                                   f"slots, but this rank expects {num_ranks} ranks and {slot_bytes}-byte slots: set "
                                   f"HVDX_NODE_SHM_SLOT_BYTES alike on every rank")
            if not 0 <= rank < num_ranks:
                raise NodeShmError(f"local rank {rank} is outside the node's {num_ranks} ranks")
            pids = segment._pids()
            owner = int(pids[rank])
            if owner and owner != os.getpid() and shm.pid_alive(owner):
                raise NodeShmError(f"local rank {rank} of {segment.path} is already attached by pid {owner}")
            pids[rank] = os.getpid()
            segment.rank = rank

        return cls._attach(name, directory=directory, admit=admit)


class NodeCommunicator:
    """The node collectives over a mapped segment, as this process's local rank.

    `alltoall(x, splits, name)` and `allgather(x, name)` return what `hvd.alltoall` (equal
    splits on every rank) and `hvd.allgather` over the node's process set return."""

    def __init__(self, segment: Segment, timeout_s: Optional[float] = None) -> None:
        self.segment = segment
        self.rank, self.size = segment.rank, segment.num_ranks
        self.timeout_s = float(timeout_s if timeout_s is not None
                               else os.environ.get("HVDX_NODE_SHM_TIMEOUT", DEFAULT_TIMEOUT_S))
        #: chain a graph's collectives in creation order (False only to test what it prevents)
        self.ordered = True
        # last op of each channel in each graph: the next one there is chained to it
        self._last: "weakref.WeakKeyDictionary[tf.Graph, Dict[int, tf.Operation]]" = weakref.WeakKeyDictionary()

    def _check(self, x, what: str, name: str) -> tf.Tensor:
        x = tf.convert_to_tensor(x)
        if "GPU" in (x.device or "").upper():
            raise ValueError(f"{what} {name!r}: node_engine='shm' takes CPU tensors only, got one on {x.device}; use "
                             f"node_engine='horovod' (NCCL) for GPU tensors")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{what} {name!r}: node_engine='shm' moves {', '.join(d.name for d in _DTYPES)}, got "
                            f"{x.dtype.name}")
        return x

    def _run(self, channel: int, build):
        if tf.executing_eagerly() or not self.ordered:
            return build()
        graph = tf.compat.v1.get_default_graph()
        chain = self._last.setdefault(graph, {})
        previous = chain.get(channel)
        with tf.control_dependencies([previous] if previous is not None else []):
            result = build()
        chain[channel] = result.op
        return result

    def alltoall(self, x, splits: Sequence[int], name: str) -> tf.Tensor:
        """Slice j of the 1-D `x` (splits[j] elements, the same splits on every rank) to local
        rank j; returns every rank's slice `self.rank`, in rank order. Collective over the node.

        Raises ValueError (not 1-D, a GPU tensor, splits that do not sum to len(x) or not one
        per rank), TypeError (dtype); at run time an error naming the other rank when the
        ranks' calls differ, or a rank that died or did not arrive within the timeout."""
        x = self._check(x, "node_alltoall", name)
        splits = [int(s) for s in splits]
        if x.shape.rank != 1:
            raise ValueError(f"node_alltoall {name!r} takes a 1-D tensor, got shape {x.shape}")
        if len(splits) != self.size or min(splits) < 0:
            raise ValueError(f"node_alltoall {name!r} needs {self.size} splits >= 0 (one per local rank), got {splits}")
        if x.shape[0] is not None and sum(splits) != x.shape[0]:
            raise ValueError(f"node_alltoall {name!r}: splits {splits} sum to {sum(splits)}, the tensor has {x.shape[0]}")
        from hvdx import ops

        def build():
            with tf.device("/cpu:0"):
                out = ops._ops.hvdx_node_alltoall(x, tf.constant(splits, tf.int64), address=self.segment.address,
                                                  channel=ALLTOALL, rank=self.rank, collective_name=name,
                                                  timeout_s=self.timeout_s)
            return tf.ensure_shape(out, [self.size * splits[self.rank]])
        return self._run(ALLTOALL, build)

    def allgather(self, x, name: str) -> tf.Tensor:
        """Every rank's rows of `x` (dimension 0, any count per rank), in rank order. Collective
        over the node; raises as `alltoall`."""
        x = self._check(x, "node_allgather", name)
        if x.shape.rank is None or x.shape.rank < 1:
            raise ValueError(f"node_allgather {name!r} takes a tensor of rank >= 1, got shape {x.shape}")
        from hvdx import ops

        def build():
            with tf.device("/cpu:0"):
                return ops._ops.hvdx_node_allgather(x, address=self.segment.address, channel=ALLGATHER,
                                                    rank=self.rank, collective_name=name, timeout_s=self.timeout_s)
        return self._run(ALLGATHER, build)


#: One communicator per process and node-local set (by its global ranks).
_COMMUNICATORS: Dict[Tuple[int, ...], NodeCommunicator] = {}


def communicator(topo=None) -> NodeCommunicator:
    """This node's communicator, set up on first use: a collective over every rank (token
    broadcast, node barriers), run eagerly also while a tf.function is traced. Every rank
    must reach it at the same point (the strategies do, when they first build a node
    collective).

    Raises NodeShmError on every rank of a node when any of its ranks fails to create or
    attach the segment (the message names the rank and why)."""
    import horovod.tensorflow as hvd

    from hvdx.topology import topology

    topo = topo or topology()
    key = tuple(topo.local_ranks)
    if key in _COMMUNICATORS:
        return _COMMUNICATORS[key]
    slot_bytes = int(os.environ.get("HVDX_NODE_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES))
    with tf.init_scope():
        token = hvd.broadcast_object(shm.token() if hvd.rank() == 0 else None, root_rank=0,
                                     name="hvdx.node.shm.token")
        name = NODE.name(token, topo.node)
        segment, error = None, None
        if topo.local_rank == 0:
            try:
                segment = Segment.create(name, topo.local_size, slot_bytes)
            except (NodeShmError, ValueError) as exc:
                error = str(exc)
        _node_check(error, "create", topo)
        if topo.local_rank != 0:
            try:
                segment = Segment.attach(name, topo.local_rank, topo.local_size, slot_bytes)
            except NodeShmError as exc:
                error = str(exc)
        try:
            _node_check(error, "attach", topo)
        finally:
            if segment is not None:
                segment.unlink()
    _COMMUNICATORS[key] = NodeCommunicator(segment)
    return _COMMUNICATORS[key]


def _node_check(error: Optional[str], step: str, topo) -> None:
    """A node barrier that raises on every rank of the node when one of them failed."""
    import horovod.tensorflow as hvd

    errors = hvd.allgather_object((topo.local_rank, error), name=f"hvdx.node.shm.{step}", process_set=topo.local_set)
    failed = [f"local rank {rank}: {message}" for rank, message in errors if message]
    if failed:
        raise NodeShmError(f"node {topo.node}: the shared-memory segment could not be set up ({step}); "
                           + "; ".join(failed) + ". Use node_engine='horovod', or fix the cause")


def node_alltoall(x, slices: Sequence[Tuple[int, int]], name: str, topo=None) -> tf.Tensor:
    """`hvd.alltoall(x, splits=[length of each slice], process_set=topo.local_set)` through the
    node's segment; `slices` are `node_slices`' (offset, length) pairs covering `x`."""
    return communicator(topo).alltoall(x, [length for _, length in slices], name)


def node_allgather(x, name: str, topo=None) -> tf.Tensor:
    """`hvd.allgather(x, process_set=topo.local_set)` through the node's segment."""
    return communicator(topo).allgather(x, name)
