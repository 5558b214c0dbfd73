"""Sparse aggregation with MSTopK and error feedback: NaiveAG and HiTopKComm (shi2021).

Both send (value, index) pairs of the k largest-magnitude entries (by MSTopK, Alg. 1) in
one all-gather (values and indices packed into one buffer), add what arrives with
sparse_accumulate, and keep what they did not send in a residual for the next step.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import ops
from hvdx.comm.base import ResidualMemory, Strategy, check_density, node_reduce_scatter_parts, padded_length
from hvdx.topology import Topology, barrier

__all__ = ["HiTopK", "SparseAllgather"]

_WIRE_DTYPES = (tf.float32, tf.float16, tf.bfloat16)


def _pack(values: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
    """One 1-D tensor of the wire dtype: the k values, then the k int32 indices' bits."""
    index_bits = tf.bitcast(indices, values.dtype)  # [k] for 32-bit values, [k, 2] for 16-bit
    return tf.concat([values, tf.reshape(index_bits, [-1])], axis=0)


def _unpack(gathered: tf.Tensor, k: int):
    """Inverse of `_pack` for the concatenation of every sender's packet: (values, indices)."""
    per_index = 1 if gathered.dtype.size == 4 else 4 // gathered.dtype.size
    packets = tf.reshape(gathered, [-1, k * (1 + per_index)])
    values = tf.reshape(packets[:, :k], [-1])
    index_bits = packets[:, k:]
    if per_index > 1:
        index_bits = tf.reshape(index_bits, [-1, k, per_index])
    return values, tf.reshape(tf.bitcast(index_bits, tf.int32), [-1])


class _TopKStrategy(Strategy):
    def __init__(self, density: float = 0.01, num_samplings: int = 30,
                 wire_dtype: tf.DType = tf.float32, topo: Optional[Topology] = None) -> None:
        super().__init__(topo)
        self.density = check_density(density)
        if not isinstance(num_samplings, int) or num_samplings < 1:
            raise ValueError(f"num_samplings must be an int >= 1, got {num_samplings!r}")
        self.num_samplings = num_samplings
        self.wire_dtype = tf.as_dtype(wire_dtype)
        if self.wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be float32, float16 or bfloat16, got {self.wire_dtype.name}")
        self._memory = ResidualMemory(self.key)
        self.last_indices: Optional[tf.Tensor] = None  # diagnostics: last step's selection

    @property
    def variables(self) -> Dict[str, tf.Variable]:
        return self._memory.variables

    def _select(self, grads: List[tf.Tensor], name: str):
        """Error feedback around MSTopK: (values, indices) of acc = sum(grads) + residual,
        and residual <- acc with the selected entries zeroed (one pass makes acc)."""
        length = int(grads[0].shape[0])
        residual = self._memory.get(name, length, grads[0].dtype)
        acc = tf.add_n([*grads, residual])
        k = max(1, int(round(self.density * length)))
        values, indices = ops.mstopk(acc, k, num_samplings=self.num_samplings)
        sent = tf.cast(tf.cast(values, self.wire_dtype), values.dtype)
        # What was not sent stays: unselected entries whole, and the wire's rounding error
        # (acc[i] - sent[i] at the selected i). sparse_accumulate updates acc in place when
        # nothing else holds it (in a tf.function): no copy of the d-vector.
        residual.assign(ops.sparse_accumulate(-sent, indices, length, out=acc))
        self.last_indices = indices
        return values, indices, k

    def _exchange(self, values, indices, k, process_set, name):
        packet = _pack(tf.cast(values, self.wire_dtype), indices)
        gathered = hvd.allgather(packet, process_set=process_set, name=name)
        return _unpack(gathered, k)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(density={self.density}, num_samplings={self.num_samplings}, "
                f"wire_dtype={self.wire_dtype.name})")


class SparseAllgather(_TopKStrategy):
    """NaiveAG: MSTopK on the whole buffer, all-gather of (value, index) pairs over all
    ranks, sparse accumulation. Every rank sends 2k elements to every other (eq. 3)."""

    key = "sparse_allgather"

    def aggregate(self, buffer: tf.Tensor, name: str) -> tf.Tensor:
        topo = self.topology
        d = int(buffer.shape[0])
        values, indices, k = self._select([buffer], name)
        values, indices = self._exchange(values, indices, k, hvd.global_process_set,
                                         f"hvdx.naiveag.ag.{name}")
        values = tf.cast(values, buffer.dtype) / tf.cast(topo.size, buffer.dtype)
        return ops.sparse_accumulate(values, indices, d)


class HiTopK(_TopKStrategy):
    """HiTopKComm (shi2021, Algorithm 2).

    1. reduce-scatter inside the node: local rank j holds the node's sum of slice j (eq. 4,
       lines 2-4);
    2. error feedback + MSTopK on that d/n slice with k = density * d/n (eq. 5, lines 5-8);
    3. all-gather of the (value, index) pairs in the cross set of local rank j: the n cross
       sets are independent streams over the slow links (eq. 6, lines 11-14);
    4. all-gather inside the node of the m k pairs each rank received (eq. 10 counts these
       rho d m / n elements, not the dense slice), then one sparse_accumulate of all of them
       into the d-vector (lines 15-22), divided by the number of ranks.
    The buffer is zero-padded to a multiple of n, so every slice has the same length.
    Set `record_times = True` to keep each step's wall time (eager mode, a barrier of all
    ranks before each step) in `last_times`.
    """

    key = "hitopk"
    STEPS = ("reduce_scatter", "mstopk", "inter_allgather", "intra_allgather")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.record_times = False
        self.last_times: Dict[str, float] = {}

    def aggregate(self, buffer: tf.Tensor, name: str) -> tf.Tensor:
        topo = self.topology
        d = int(buffer.shape[0])
        n = topo.local_size
        slice_length = padded_length(d, n) // n
        clock = _StepClock(self.record_times)
        padded = buffer if d % n == 0 else tf.pad(buffer, [[0, padded_length(d, n) - d]])
        parts = node_reduce_scatter_parts(padded, topo, f"hvdx.hitopk.rs.{name}")
        clock.lap("reduce_scatter")  # (the n parts are added to the residual in the next step)
        values, indices, k = self._select([tf.ensure_shape(p, [slice_length]) for p in parts], name)
        clock.lap("mstopk")
        values, indices = self._exchange(values, indices, k, topo.cross_set, f"hvdx.hitopk.ag.{name}")
        clock.lap("inter_allgather")
        offset = topo.local_set.rank() * slice_length  # this rank's slice in the d-vector
        values, indices = self._exchange(values, indices + offset, topo.num_nodes * k, topo.local_set,
                                         f"hvdx.hitopk.ag2.{name}")
        # Averaging the m n k pairs rather than the d-vector saves a pass over d elements.
        values = tf.cast(values, buffer.dtype) / tf.cast(topo.size, buffer.dtype)
        total = ops.sparse_accumulate(values, indices, n * slice_length)
        if n * slice_length != d:  # padding (zeros) may be selected when few entries are nonzero
            total = total[:d]
        clock.lap("intra_allgather")
        if self.record_times:
            self.last_times = clock.times
        return total


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
