"""Dense aggregation: Horovod's allreduce, and 2DTAR (hierarchical allreduce on CPU too)."""
from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx.comm.base import Strategy, node_reduce_scatter, padded_length

__all__ = ["Allreduce", "Hierarchical"]


class Allreduce(Strategy):
    """The dense baseline: one Horovod allreduce (average) over all ranks."""

    key = "allreduce"

    def aggregate(self, buffer: tf.Tensor, name: str) -> tf.Tensor:
        return hvd.allreduce(buffer, op=hvd.Average, name=f"hvdx.allreduce.{name}")


class Hierarchical(Strategy):
    """2DTAR (shi2021 sec. 5.3): reduce-scatter inside the node, allreduce of each slice
    across nodes in its cross set, all-gather inside the node.

    Horovod's own hierarchical allreduce needs NCCL; this one runs wherever process sets do.
    Only 1/n of the buffer crosses the slow inter-node links from each rank.
    """

    key = "hierarchical"

    def aggregate(self, buffer: tf.Tensor, name: str) -> tf.Tensor:
        topo = self.topology
        d = int(buffer.shape[0])
        n = topo.local_size
        padded = buffer if d % n == 0 else tf.pad(buffer, [[0, padded_length(d, n) - d]])
        mine = node_reduce_scatter(padded, topo, f"hvdx.2dtar.rs.{name}")
        total = hvd.allreduce(mine, op=hvd.Sum, process_set=topo.cross_set, name=f"hvdx.2dtar.ar.{name}")
        averaged = total / tf.cast(topo.size, total.dtype)
        gathered = hvd.allgather(averaged, process_set=topo.local_set, name=f"hvdx.2dtar.ag.{name}")
        return gathered if d % n == 0 else gathered[:d]
