"""2DTAR (shi2021 sec. 5.3): hierarchical allreduce over hvdx's node-local and cross sets, on CPU too."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import timeline
from hvdx.arguments import integer
from hvdx.comm import wire
from hvdx.comm.base import Aggregated, Strategy
from hvdx.comm.registry import register
from hvdx.node.collectives import check_engine, node_allgather, node_reduce_scatter, node_slices
from hvdx.topology import Topology

__all__ = ["DEFAULT_FLAT_BELOW", "Hierarchical", "average_node_slices"]


#: Below this many bytes on the wire a bucket goes through one flat allreduce per gradient
#: (`Hierarchical.flat_below`): three latency-bound collectives cost more than the inter-node
#: bytes they save (benchmarks/README.md, train_step.py's hierarchical_sized).
DEFAULT_FLAT_BELOW = 4 << 20


def average_node_slices(mine: tf.Tensor, d: int, dtype: tf.DType, topo: Topology, prefix: str, name: str,
                        engine: str = "horovod", label: str = "") -> Tuple[tf.Tensor, tf.Tensor]:
    """2DTAR's cross-node and node steps (shi2021 sec. 5.3) after the node's reduce-scatter:
    `mine`, this rank's node sum of its slice (`node_slices`) of a d-element buffer, summed
    in its cross set (all-reduce `{prefix}.ar.{name}`), divided by the number of ranks, and
    all-gathered inside the node (`{prefix}.ag.{name}`, by `engine`). The collectives move
    mine's dtype. Returns (this rank's averaged slice, the averaged d-vector), in `dtype`."""
    (mine,) = timeline.span([mine], label, name, "inter_allreduce", "begin")
    total = hvd.allreduce(mine, op=hvd.Sum, process_set=topo.cross_set, name=f"{prefix}.ar.{name}")
    (total,) = timeline.span([total], label, name, "inter_allreduce", "end")
    averaged = tf.cast(total, dtype) / tf.cast(topo.size, dtype)
    (averaged,) = timeline.span([averaged], label, name, "intra_allgather", "begin")
    gathered = node_allgather(tf.cast(averaged, mine.dtype), topo, f"{prefix}.ag.{name}",
                              engine)  # slices of different lengths: fine
    (gathered,) = timeline.span([gathered], label, name, "intra_allgather", "end")
    # [:d] drops a small buffer's padding; otherwise it is the whole tensor (no copy).
    return averaged, tf.reshape(tf.cast(gathered[:d], dtype), [d])


@register("hierarchical", aliases=("2dtar",))
class Hierarchical(Strategy):
    """2DTAR (shi2021 sec. 5.3): reduce-scatter inside the node, allreduce of each slice
    across nodes in its cross set, all-gather inside the node.

    Horovod's own hierarchical allreduce needs NCCL; this one runs wherever process sets do.
    Only 1/n of the buffer crosses the slow inter-node links from each rank. A bucket smaller
    than `flat_below` bytes on the wire is latency-bound, not bandwidth-bound: it goes through
    Horovod's flat allreduce instead, one per gradient, which Horovod fuses with whatever else
    is ready (as NCCL picks its algorithm by message size); such a bucket leaves no
    reduce-scattered slice (`Aggregated.local_slice` None).

    Args:
      wire_dtype: the type every collective moves (e.g. float16); None: the buffer's.
      flat_below: bytes on the wire under which a bucket is averaged flat (default
        DEFAULT_FLAT_BELOW, 4 MiB); 0: every bucket through 2DTAR (shi2021's algorithm as
        written).
      node_engine: what runs the node-local reduce-scatter and all-gather: "horovod"
        (default, over the node's process set) or "shm" (hvdx's shared-memory segment per
        node, `hvdx.node.shm_engine`; set up collectively on the first trace). "shm" pays under
        Gloo, whose node-local bytes otherwise cross TCP loopback; under MPI or NCCL it is
        allowed but rarely faster. CPU tensors only (a GPU buffer raises ValueError). A node of
        one rank makes no node collective either way.
    Raises:
      ValueError: a negative or non-integer flat_below, an unknown node_engine.
      hvdx.node.shm_engine.NodeShmError: (first call, "shm") a rank of the node could not
        create or attach the segment; tf.errors.InternalError at run time when the node's
        ranks issue different node collectives, or one died or did not arrive within
        HVDX_NODE_SHM_TIMEOUT seconds (the message names it).
    """

    options = ("wire_dtype", "flat_below", "node_engine")
    quiet_defaults = {"flat_below": DEFAULT_FLAT_BELOW, "node_engine": "horovod"}
    #: 4 MiB buckets by default: a bucket's three collectives start while backpropagation goes
    #: on (measured on the emulated 2x2 cluster, benchmarks/README.md: the CNN whose
    #: gradients fill one 32 MiB bucket goes from 0.87x Horovod's step to 1.02x; MLP 1.24x
    #: -> 1.23x, ResNet 1.01x -> 1.00x).
    bucket_bytes = 4 << 20

    def __init__(self, wire_dtype=None, flat_below: int = DEFAULT_FLAT_BELOW, topo: Optional[Topology] = None,
                 node_engine: str = "horovod") -> None:
        super().__init__(topo)
        self.node_engine = check_engine(node_engine)
        flat_below = integer(flat_below, "flat_below", 0,
                             expected="a number of bytes >= 0 (0: every bucket through 2DTAR)")
        self.wire_dtype = None if wire_dtype is None else wire.check_dtype(wire_dtype)
        self.flat_below = flat_below

    def _flat(self, elements: int, dtype: tf.DType) -> bool:
        """Whether a bucket of `elements` of `dtype` is averaged flat (the size rule)."""
        return elements * (self.wire_dtype or tf.as_dtype(dtype)).size < self.flat_below

    def _flat_allreduce(self, pieces: Sequence[tf.Tensor], name: str, grouped: bool = False) -> List[tf.Tensor]:
        """Horovod's flat average of each piece (one grouped allreduce of them all when
        `grouped`), in `wire_dtype` on the wire."""
        sent = [p if self.wire_dtype is None else tf.cast(p, self.wire_dtype) for p in pieces]
        if grouped and len(sent) > 1:
            totals = hvd.grouped_allreduce(sent, op=hvd.Average, name=f"hvdx.2dtar.flat.{name}")
        else:
            totals = [hvd.allreduce(s, op=hvd.Average, name=f"hvdx.2dtar.flat.{name}.{j}") for j, s in enumerate(sent)]
        return [tf.cast(t, p.dtype) for t, p in zip(totals, pieces)]

    def _aggregate_pieces(self, pieces: Sequence[tf.Tensor], name: str, residual_scale=None, grouped: bool = False,
                          shapes=None) -> Tuple[List[tf.Tensor], Aggregated]:
        """A small bucket (`flat_below`): one flat allreduce per piece (one for all of them
        when `grouped`); otherwise the pieces fused and averaged by 2DTAR."""
        pieces = list(pieces)
        if not self._flat(sum(int(p.shape[0]) for p in pieces), pieces[0].dtype):
            return super()._aggregate_pieces(pieces, name, residual_scale)
        return self._flat_allreduce(pieces, name, grouped), Aggregated(None)

    def _aggregate(self, buffer: tf.Tensor, name: str, residual_scale=None) -> Aggregated:
        if self._flat(int(buffer.shape[0]), buffer.dtype):
            return Aggregated(self._flat_allreduce([buffer], name)[0])
        topo = self.topology
        d = int(buffer.shape[0])
        offset, length = node_slices(d, topo.local_size)[topo.local_set.rank()]
        label = self.progress_label
        sent = buffer if self.wire_dtype is None else tf.cast(buffer, self.wire_dtype)
        (sent,) = timeline.span([sent], label, name, "intra_reduce_scatter", "begin")
        mine = node_reduce_scatter(sent, topo, f"hvdx.2dtar.rs.{name}", self.node_engine)
        (mine,) = timeline.span([mine], label, name, "intra_reduce_scatter", "end")
        averaged, output = average_node_slices(tf.ensure_shape(mine, [length]), d, buffer.dtype, topo, "hvdx.2dtar",
                                               name, self.node_engine, label)
        return Aggregated(output, local_slice=(averaged, offset))

    def __repr__(self) -> str:
        options = [f"wire_dtype={self.wire_dtype.name}"] if self.wire_dtype else []
        return f"Hierarchical({', '.join(options + self._changed_options())})"
