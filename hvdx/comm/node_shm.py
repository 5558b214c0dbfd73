"""Node-local collectives through shared memory: the `node_engine="shm"` of 2DTAR and HiTopK.

2DTAR and HiTopKComm run an all-to-all (the node-local reduce-scatter) and all-gathers inside
each node. Through Horovod under Gloo those bytes cross TCP loopback; here they go through one
shared-memory segment per node, written and read by the node's ranks with two copies and a
futex barrier (csrc/kernels/node_shm.h has the layout and the protocol).

Life of a segment (nothing is left in /dev/shm after any exit, SIGKILL included):

1. `setup()` (collective over all ranks, once per process and topology): rank 0 draws a token
   and Horovod broadcasts it; the node's local rank 0 creates `/dev/shm/hvdx-node-<token>-<node>`
   (O_EXCL), writes the header and registers an atexit hook that unlinks it.
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

import atexit
import fcntl
import mmap
import os
import secrets
import struct
import weakref
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["ALLGATHER", "ALLTOALL", "ENGINES", "NodeCommunicator", "NodeShmError", "PREFIX", "SHM_DIR", "Segment",
           "check_engine", "communicator", "node_allgather", "node_alltoall", "sweep"]

#: The values of the strategies' `node_engine` option.
ENGINES = ("horovod", "shm")
SHM_DIR = Path("/dev/shm")
PREFIX = "hvdx-node-"
MAGIC = b"HVDXNSM1"
LAYOUT_VERSION = 1
MAX_RANKS = 64
#: Channels of a segment: each an independent communicator with its own order.
ALLTOALL, ALLGATHER = 0, 1
CHANNELS = 2
#: Bytes of one rank's data slots per channel (HVDX_NODE_SHM_SLOT_BYTES), half in each of the
#: two alternating buffers; larger collectives run in chunks. A node of n ranks maps 2 n of them.
DEFAULT_SLOT_BYTES = 8 << 20
DEFAULT_TIMEOUT_S = 300.0
_PAGE = 4096
_HEADER = struct.Struct("<8sIIIIQQQQQi188x")  # SegmentHeader of csrc/kernels/node_shm.h, pids after it
assert _HEADER.size == 256
_PIDS = 256
_ATTACHED = 20  # byte offset of SegmentHeader::attached
_CHANNEL_HEADER, _RECORD = 256, 256
_DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.uint8, tf.int8, tf.int16,
           tf.uint16, tf.bool)


class NodeShmError(RuntimeError):
    """A node segment could not be created, attached or used."""


def check_engine(node_engine: str) -> str:
    """A strategy's `node_engine` option: "horovod" or "shm"; ValueError otherwise."""
    if node_engine not in ENGINES:
        raise ValueError(f"node_engine must be one of {ENGINES} ('horovod': the node's collectives through Horovod, "
                         f"'shm': through hvdx's shared-memory segment), got {node_engine!r}")
    return node_engine


def _align(x: int, to: int) -> int:
    return (x + to - 1) // to * to


def _layout(num_ranks: int, slot_bytes: int) -> Tuple[int, int, int, int]:
    """(channel_offset, slots_offset, channel_stride, total bytes) of a segment."""
    channel_offset = 512
    slots_offset = _align(_CHANNEL_HEADER + 64 * MAX_RANKS + 2 * _RECORD * num_ranks, _PAGE)
    stride = _align(slots_offset + slot_bytes * num_ranks, _PAGE)
    return channel_offset, slots_offset, stride, _align(channel_offset + CHANNELS * stride, _PAGE)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(directory: Path = SHM_DIR) -> List[str]:
    """Removes node segments whose creator (pid in the header) no longer exists; returns their
    names. Only a creator killed before it unlinked leaves one."""
    removed = []
    for path in Path(directory).glob(PREFIX + "*"):
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
            if len(head) < _HEADER.size or head[:8] != MAGIC:
                continue
            pid = _HEADER.unpack(head)[-1]
            if pid > 0 and not _pid_alive(pid):
                path.unlink()
                removed.append(path.name)
        except (FileNotFoundError, PermissionError):
            continue
    return removed


class Segment:
    """One node's mapped segment. Build with `create` (local rank 0) or `attach`."""

    def __init__(self, path: Path, fd: int, rank: int, creator: bool) -> None:
        self.path, self.rank, self.creator = path, rank, creator
        total = os.fstat(fd).st_size
        if total < 512:
            raise NodeShmError(f"{path} is {total} bytes: not an hvdx node segment")
        self._mmap = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._buffer = np.frombuffer(self._mmap, np.uint8)
        self._unlinked = not creator

    @classmethod
    def create(cls, name: str, num_ranks: int, slot_bytes: int = DEFAULT_SLOT_BYTES, *,
               directory: Path = SHM_DIR) -> "Segment":
        """Creates the segment `name` for `num_ranks` ranks (this process is local rank 0) and
        registers an atexit unlink. Raises ValueError for bad sizes, NodeShmError when the name
        exists or /dev/shm cannot hold it."""
        if not 1 <= num_ranks <= MAX_RANKS:
            raise ValueError(f"a node segment serves 1 to {MAX_RANKS} ranks, got {num_ranks}")
        if slot_bytes < _PAGE or slot_bytes % _PAGE:
            raise ValueError(f"slot_bytes must be a multiple of {_PAGE} (HVDX_NODE_SHM_SLOT_BYTES), got {slot_bytes}")
        channel_offset, slots_offset, stride, total = _layout(num_ranks, slot_bytes)
        path = Path(directory) / name
        sweep(directory)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise NodeShmError(f"cannot create the node segment {path}: {exc}") from exc
        _CREATED.add(path)
        try:
            os.ftruncate(fd, total)
            os.posix_fallocate(fd, 0, total)  # a full /dev/shm fails here, not with SIGBUS later
            with mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                _HEADER.pack_into(mm, 0, b"\0" * 8, LAYOUT_VERSION, num_ranks, CHANNELS, 0, slot_bytes,
                                  channel_offset, stride, slots_offset, total, os.getpid())
                mm[0:8] = MAGIC
            segment = cls(path, fd, 0, True)
            fcntl.flock(fd, fcntl.LOCK_EX)  # an early attacher counts itself under the same lock
            try:
                segment._register(num_ranks, slot_bytes)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            _remove(path)
            raise NodeShmError(f"/dev/shm cannot hold a {total}-byte node segment ({exc}): free space there, mount it "
                               f"larger (docker: --shm-size) or lower HVDX_NODE_SHM_SLOT_BYTES") from exc
        finally:
            os.close(fd)
        return segment

    @classmethod
    def attach(cls, name: str, rank: int, num_ranks: int, slot_bytes: int = DEFAULT_SLOT_BYTES, *,
               directory: Path = SHM_DIR) -> "Segment":
        """Maps the segment `name` as local rank `rank` of `num_ranks` and records this
        process's pid. Raises NodeShmError when it is missing or its layout, number of ranks
        or slot size differ, or `rank` is taken by a live process."""
        path = Path(directory) / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise NodeShmError(f"cannot open the node segment {path} ({exc}): the node's local rank 0 did not create "
                               f"it or removed it already") from exc
        try:
            segment = cls(path, fd, rank, False)
            fcntl.flock(fd, fcntl.LOCK_EX)  # attaching is rare: count under a file lock
            try:
                segment._register(num_ranks, slot_bytes)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        return segment

    def _register(self, num_ranks: int, slot_bytes: int) -> None:
        magic, version, ranks, _, _, slots, *_ = _HEADER.unpack_from(self._mmap, 0)
        if magic != MAGIC or version != LAYOUT_VERSION:
            raise NodeShmError(f"{self.path} is not an hvdx node segment of layout {LAYOUT_VERSION} (magic {magic!r}, "
                               f"layout {version})")
        if ranks != num_ranks or slots != slot_bytes:
            raise NodeShmError(f"{self.path} serves {ranks} ranks with {slots}-byte slots, but this rank expects "
                               f"{num_ranks} ranks and {slot_bytes}-byte slots: set HVDX_NODE_SHM_SLOT_BYTES alike "
                               f"on every rank")
        if not 0 <= self.rank < num_ranks:
            raise NodeShmError(f"local rank {self.rank} is outside the node's {num_ranks} ranks")
        pids = np.frombuffer(self._mmap, np.int32, MAX_RANKS, _PIDS)
        owner = int(pids[self.rank])
        if owner and owner != os.getpid() and _pid_alive(owner):
            raise NodeShmError(f"local rank {self.rank} of {self.path} is already attached by pid {owner}")
        pids[self.rank] = os.getpid()
        attached = np.frombuffer(self._mmap, np.uint32, 1, _ATTACHED)
        attached[0] += 1
        self.num_ranks, self.slot_bytes = num_ranks, slot_bytes

    @property
    def attached(self) -> int:
        """How many ranks have attached (the creator included)."""
        return int(np.frombuffer(self._mmap, np.uint32, 1, _ATTACHED)[0])

    @property
    def address(self) -> int:
        """The segment's address in this process (the ops' `address` attribute)."""
        return int(self._buffer.ctypes.data)

    def unlink(self) -> None:
        """Removes the name (creator only; idempotent). Mapped memory stays until every
        process that maps it has exited."""
        if self.creator and not self._unlinked:
            self._unlinked = True
            _remove(self.path)


#: Names this process created and has not unlinked yet (atexit removes them).
_CREATED: set = set()


def _remove(path: Path) -> None:
    _CREATED.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _unlink_created() -> None:
    for path in list(_CREATED):
        _remove(path)


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
        token = hvd.broadcast_object(secrets.token_hex(6) if hvd.rank() == 0 else None, root_rank=0,
                                     name="hvdx.node_shm.token")
        name = f"{PREFIX}{token}-{topo.node}"
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

    errors = hvd.allgather_object((topo.local_rank, error), name=f"hvdx.node_shm.{step}", process_set=topo.local_set)
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
