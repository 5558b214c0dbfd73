"""The node-local collectives of the hierarchical strategies (2DTAR, HiTopKComm; shi2021
eqs. 4-7): how a node's buffer is cut into its ranks' slices, the reduce-scatter and the
all-gather over the node-local process set, through Horovod or through the node's
shared-memory segment (`engine="shm"`, `hvdx.node.shm_engine`). Collective over the
node-local set of `hvdx.topology`.
"""
from __future__ import annotations

from typing import List, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx.node import shm_engine
from hvdx.topology import Topology

__all__ = ["ENGINES", "SLICE_ALIGN", "check_engine", "node_allgather", "node_reduce_scatter",
           "node_reduce_scatter_parts", "node_slices", "padded_length"]

#: The engines of the node-local collectives: the values of the strategies' `node_engine`.
ENGINES = ("horovod", "shm")


def check_engine(node_engine: str) -> str:
    """A strategy's `node_engine` option: "horovod" or "shm"; ValueError otherwise."""
    if node_engine not in ENGINES:
        raise ValueError(f"node_engine must be one of {ENGINES} ('horovod': the node's collectives through Horovod, "
                         f"'shm': through hvdx's shared-memory segment), got {node_engine!r}")
    return node_engine


def padded_length(d: int, parts: int) -> int:
    """d rounded up to a multiple of `parts`."""
    return -(-d // parts) * parts


#: Node slices start at multiples of this many elements (64 bytes of float32), so that the
#: slices a node's all-to-all delivers are aligned views of its output, not copies.
SLICE_ALIGN = 16


def node_slices(d: int, n: int) -> List[Tuple[int, int]]:
    """(offset, length) of the n node-local slices of a d-element buffer: slice j belongs to
    the j-th rank of the node-local set. Slices are equal multiples of SLICE_ALIGN but for
    the last, which is shorter: no padding, no copy of the buffer. A buffer too small for
    that (d < 32 n^2) is cut into n equal slices of its zero-padded length instead (the
    slices past d are then partly or wholly padding)."""
    if n == 1:
        return [(0, d)]
    if d >= 32 * n * n:
        size = -(-d // (n * SLICE_ALIGN)) * SLICE_ALIGN
        return [(j * size, min(size, d - j * size)) for j in range(n)]
    size = padded_length(d, n) // n
    return [(j * size, size) for j in range(n)]


def node_reduce_scatter_parts(buffer: tf.Tensor, topo: Topology, name: str, engine: str = "horovod"
                              ) -> List[tf.Tensor]:
    """Tensors whose sum is the node's sum of this rank's slice of `buffer` (shi2021 eq. 4),
    the slices of `node_slices` (a small buffer is zero-padded first). Collective over the
    node-local set.

    engine "shm": the all-to-all below through the node's shared-memory segment
    (`hvdx.node.shm_engine`) instead of Horovod, whatever the controller.

    Under Gloo: one all-to-all (rank j receives every rank's slice j, the (n-1)/n d
    elements of eq. 7) and the n received slices are returned, for the caller to add in
    the pass it makes anyway (HiTopK adds its residual in the same one); Horovod 0.28's
    Gloo reducescatter is slower (docs/comm.md). Elsewhere (MPI, NCCL): the native
    reducescatter where its even split is `node_slices`' (one tensor), else the all-to-all.
    """
    n = topo.local_size
    d = int(buffer.shape[0])
    slices = node_slices(d, n)
    if n == 1:
        return [buffer]
    total = slices[-1][0] + slices[-1][1]
    if total > d:
        buffer = tf.pad(buffer, [[0, total - d]])
    length = slices[topo.local_set.rank()][1]
    if engine == "shm":
        received = shm_engine.node_alltoall(buffer, slices, f"{name}.a2a", topo)
        return tf.unstack(tf.reshape(received, [n, length]))
    if not hvd.gloo_enabled() and len({size for _, size in slices}) == 1:
        return [hvd.reducescatter(buffer, op=hvd.Sum, process_set=topo.local_set, name=f"{name}.rs")]
    received, _ = hvd.alltoall(buffer, splits=[size for _, size in slices], process_set=topo.local_set,
                               name=f"{name}.a2a")
    # n slices of this rank's length: views of `received` when the length is aligned.
    return tf.unstack(tf.reshape(received, [n, length]))


def node_reduce_scatter(buffer: tf.Tensor, topo: Topology, name: str, engine: str = "horovod") -> tf.Tensor:
    """The node's sum of this rank's slice of `buffer` (see `node_reduce_scatter_parts`)."""
    parts = node_reduce_scatter_parts(buffer, topo, name, engine)
    return parts[0] if len(parts) == 1 else tf.add_n(parts)


def node_allgather(tensor: tf.Tensor, topo: Topology, name: str, engine: str = "horovod") -> tf.Tensor:
    """Every node-local rank's `tensor` (dimension 0 may differ per rank), in local rank
    order: `hvd.allgather` over the node-local set, or through the node's shared-memory
    segment (engine "shm", `hvdx.node.shm_engine`). Collective over the node-local set."""
    if engine == "shm" and topo.local_size > 1:
        return shm_engine.node_allgather(tensor, name, topo)
    return hvd.allgather(tensor, process_set=topo.local_set, name=name)
