"""HiTopKComm (shi2021, Algorithm 2): hierarchical top-k communication."""
from __future__ import annotations

import time
from typing import Dict, Optional

import tensorflow as tf

from hvdx import ops, timeline
from hvdx.comm.base import Aggregated
from hvdx.comm.hierarchical import average_node_slices
from hvdx.comm.registry import register
from hvdx.comm.sparse import TopKStrategy
from hvdx.node.collectives import check_engine, node_reduce_scatter_parts, node_slices
from hvdx.topology import barrier

__all__ = ["HiTopK"]


@register("hitopk", aliases=("hitopkcomm",))
class HiTopK(TopKStrategy):
    """HiTopKComm (shi2021, Algorithm 2).

    1. reduce-scatter inside the node: local rank j holds the node's sum of slice j (eq. 4,
       lines 2-4);
    2. error feedback + MSTopK on that d/n slice with k = density * d/n (eq. 5, lines 5-8);
    3. all-gather of the (value, index) pairs in the cross set of local rank j: the n cross
       sets are independent streams over the slow links (eq. 6, lines 11-14);
    4. all-gather inside the node of the m k pairs each rank received (eq. 10 counts these
       rho d m / n elements, not the dense slice), then one sparse_accumulate of all of them
       into the d-vector (lines 15-22), divided by the number of ranks.
    The node's slices are those of `node_slices` (aligned, the last one shorter; no copy
    of the buffer), and k = density * slice length on each, plus the slice's entries of the
    gradients sent whole (`dense_below`). A density warm-up's stages at `dense_from` or above
    (0.5 on two nodes with float32 pairs: an Adam's dense start) go through 2DTAR instead.
    Set `record_times = True` to keep each step's wall time (eager mode, a barrier of all
    ranks before each step) in `last_times`.

    Args: those of `TopKStrategy` (density, num_samplings, wire_dtype, DGC's aids; value_bits
      quantizes step 3's values, across nodes, while step 4 forwards them decoded in float32
      inside the node, so no second rounding escapes the residuals), and
      node_engine: what runs steps 1 and 4 inside the node: "horovod" (default, over the
        node's process set) or "shm" (hvdx's shared-memory segment per node,
        `hvdx.node.shm_engine`; set up collectively on the first trace). "shm" pays under Gloo,
        whose node-local bytes otherwise cross TCP loopback; under MPI or NCCL it is allowed
        but rarely faster. CPU tensors only. A node of one rank makes no node collective.
    Raises:
      ValueError: a bad option; node_engine="shm" with warmup_steps (the warm-up builds the
        exchange inside tf.switch_case branches, where node collectives are not ordered).
      hvdx.node.shm_engine.NodeShmError, tf.errors.InternalError: as `Hierarchical`'s with "shm".
    """

    STEPS = ("reduce_scatter", "mstopk", "inter_allgather", "intra_allgather")
    options = (*TopKStrategy.options, "node_engine")
    quiet_defaults = {**TopKStrategy.quiet_defaults, "node_engine": "horovod"}

    def __init__(self, *args, node_engine: str = "horovod", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.node_engine = check_engine(node_engine)
        if self.node_engine == "shm" and self.warmup_steps:
            raise ValueError("HiTopK(node_engine='shm') does not take warmup_steps: the density warm-up builds the "
                             "exchange in tf.switch_case branches, where shared-memory node collectives are not "
                             "ordered. Use node_engine='horovod' with the warm-up")
        self.record_times = False
        self.last_times: Dict[str, float] = {}

    def residual_length(self, d: int) -> int:
        """The longest node slice of a d-element buffer (`node_slices`): every rank keeps a
        residual of that length (the shorter last slice leaves its tail at zero)."""
        return node_slices(d, self.topology.local_size)[0][1]

    def gather_members(self) -> int:
        """The pairs cross the slow links in the cross sets: one member per node."""
        return self.topology.num_nodes

    def _dense_aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None
                         ) -> Aggregated:
        """A warm-up stage at `dense_from` or above, by 2DTAR with error feedback: the node's
        reduce-scatter (step 1), the residual added to this rank's slice, then
        `average_node_slices` in float32 (all-reduce in the cross set, node all-gather)."""
        topo = self.topology
        d = int(buffer.shape[0])
        slices = node_slices(d, topo.local_size)
        offset, slice_length = slices[topo.local_set.rank()]
        label = self.progress_label
        (buffer,) = timeline.span([buffer], label, name, "reduce_scatter", "begin")
        parts = node_reduce_scatter_parts(buffer, topo, f"hvdx.hitopk.rs.{name}", self.node_engine)
        parts = timeline.span(parts, label, name, "reduce_scatter", "end")
        acc, velocity = self._accumulate([tf.ensure_shape(p, [slice_length]) for p in parts], name, residual_scale,
                                         self.residual_length(d))
        averaged, total = average_node_slices(acc, d, tf.float32, topo, "hvdx.hitopk.dense", name, self.node_engine,
                                              label)
        # a small buffer's last slices are partly or wholly padding (node_slices): only the first d count
        mine = (averaged if offset + slice_length <= d else averaged[:max(d - offset, 0)], offset)
        updates = self._dense_updates(name, acc, velocity, offset, self.residual_length(d), residual_scale)
        return Aggregated(total, updates, local_slice=mine, finite=self._finite(total))

    def _sparse_aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None) -> Aggregated:
        topo = self.topology
        d = int(buffer.shape[0])
        n = topo.local_size
        slices = node_slices(d, n)
        offset, slice_length = slices[topo.local_set.rank()]  # this rank's slice of the d-vector
        clock = _StepClock(self.record_times)
        label = self.progress_label
        (buffer,) = timeline.span([buffer], label, name, "reduce_scatter", "begin")
        parts = node_reduce_scatter_parts(buffer, topo, f"hvdx.hitopk.rs.{name}", self.node_engine)
        parts = timeline.span(parts, label, name, "reduce_scatter", "end")
        clock.lap("reduce_scatter")  # (the n parts are added to the residual in the next step)
        parts = timeline.span(parts, label, name, "mstopk + error feedback", "begin")
        chosen = self._select([tf.ensure_shape(p, [slice_length]) for p in parts], name, residual_scale,
                              stored=self.residual_length(d), offset=offset)
        sent = [chosen.values, chosen.indices] + ([] if chosen.packet is None else [chosen.packet])
        sent = timeline.span(sent, label, name, "mstopk + error feedback", "end")
        clock.lap("mstopk")
        # The cross set's members hold the same slice (same k); the node's hold slices of
        # different lengths (the last is shorter), so each sends its own m k pairs. With
        # value_bits only this slow exchange carries codes; the node's forwards their decoded values.
        sent = timeline.span(sent, label, name, "inter_allgather", "begin")
        values, indices = self._exchange(sent[0], sent[1], chosen.k, topo.cross_set, f"hvdx.hitopk.ag.{name}",
                                         packet=sent[2] if len(sent) > 2 else None)
        values, indices = timeline.span([values, indices], label, name, "inter_allgather", "end")
        clock.lap("inter_allgather")
        values, indices = timeline.span([values, indices], label, name, "intra_allgather + accumulate", "begin")
        node_k = [topo.num_nodes * self.k_sent(start, length) for start, length in slices]
        values, indices = self._exchange(values, indices + tf.cast(offset, indices.dtype),
                                         node_k if len(set(node_k)) > 1 else node_k[0],
                                         topo.local_set, f"hvdx.hitopk.ag2.{name}", self.node_engine)
        # Averaging the m n k pairs rather than the d-vector saves a pass over d elements.
        values = values / tf.cast(topo.size, values.dtype)
        padded = slices[-1][0] + slices[-1][1]
        total = ops.sparse_accumulate(values, indices, padded)
        if padded != d:  # a small buffer's padding (zeros) may be selected when few entries are nonzero
            total = total[:d]
        (total,) = timeline.span([total], label, name, "intra_allgather + accumulate", "end")
        clock.lap("intra_allgather")
        if self.record_times:
            self.last_times = clock.times
        mine = (total[offset:offset + slice_length] if offset + slice_length <= d else total[offset:], offset)
        return Aggregated(total, chosen.updates, local_slice=mine, finite=self._finite(values))


class _StepClock:
    """Wall time of each step of an eager call, for Figure 8. Recording puts a barrier of all
    ranks before every step, so a step's time is its own, not a wait for a slower rank's
    previous step (eager CPU ops run synchronously)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.times: Dict[str, float] = {}
        self._last = self._sync() if enabled else 0.0

    @staticmethod
    def _sync() -> float:
        barrier()
        return time.perf_counter()

    def lap(self, step: str) -> None:
        if self.enabled:
            self.times[step] = time.perf_counter() - self._last
            self._last = self._sync()
