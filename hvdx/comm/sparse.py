"""What the sparse strategies share: error feedback around MSTopK, and the exchange.

A sparse strategy adds its residual to this step's buffer, selects k = density * length
entries of large magnitude with MSTopK (shi2021 Alg. 1), sends their (value, index) pairs
in one all-gather (`hvdx.comm.wire`), and keeps everything it did not send, including
the wire's rounding, as its next residual (committed only on finite steps).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import ops
from hvdx.comm import wire
from hvdx.comm.base import Strategy, check_density, check_positive_int
from hvdx.comm.memory import ResidualMemory, Update
from hvdx.topology import Topology

__all__ = ["TopKStrategy"]

#: The density the sparse strategies use when none is given.
DEFAULT_DENSITY = 0.01


class TopKStrategy(Strategy):
    """Base of NaiveAG and HiTopK: error feedback + MSTopK + (value, index) all-gather."""

    lossy = True
    options = ("density", "num_samplings", "wire_dtype")

    def __init__(self, density: float = DEFAULT_DENSITY, num_samplings: int = 30,
                 wire_dtype: tf.DType = tf.float32, topo: Optional[Topology] = None,
                 index_dtype: Optional[tf.DType] = None) -> None:
        super().__init__(topo)
        #: MSTopK's index type: None picks int32 below 2**31 elements (the aggregator's
        #: buckets always are), int64 above; tf.int64 forces the wide path end to end.
        self.index_dtype = index_dtype
        self.density = check_density(density)
        self.num_samplings = check_positive_int(num_samplings, "num_samplings")
        self.wire_dtype = wire.check_dtype(wire_dtype)
        self._memory = ResidualMemory(self.key)
        self.last_indices: Optional[tf.Tensor] = None  # diagnostics: last call's selection

    @property
    def memory(self) -> ResidualMemory:
        return self._memory

    def residual_length(self, d: int) -> int:
        """The length of the residual kept for a d-element buffer: the same on every rank,
        so that a checkpoint restores anywhere (a residual written by another rank then
        reads as zeros, `ResidualMemory.read`)."""
        return d

    def create_state(self, name: str, d: int) -> None:
        self._memory.variable(name, self.residual_length(d), tf.float32)

    def k(self, length: int) -> int:
        """How many entries of a `length`-element buffer are sent: max(1, round(density * length))."""
        return max(1, int(round(self.density * length)))

    def _select(self, grads: List[tf.Tensor], name: str, residual_scale: Optional[tf.Tensor],
                stored: Optional[int] = None) -> Tuple[tf.Tensor, tf.Tensor, int, List[Update]]:
        """Error feedback around MSTopK: (values, indices, k, residual updates) for
        acc = sum(grads) + residual; the new residual is acc with the sent values taken out.
        `stored`: the residual's length where it exceeds the grads' (its tail stays zero)."""
        length = int(grads[0].shape[0])
        if grads[0].dtype != tf.float32:
            raise ValueError(f"{type(self).__name__} aggregates float32 buffers, got {grads[0].dtype.name}")
        stored = length if stored is None else stored
        with tf.name_scope("error_feedback"):
            residual = self._memory.read(name, stored, tf.float32, residual_scale)
            acc = tf.add_n([*grads, residual if stored == length else residual[:length]])
        k = self.k(length)
        values, indices = ops.mstopk(acc, k, num_samplings=self.num_samplings, index_dtype=self.index_dtype)
        sent = wire.decode_sent(values, self.wire_dtype)
        # What was not sent stays: unselected entries whole, and the wire's rounding at the
        # selected ones. sparse_accumulate updates acc in place (nothing else reads it now).
        with tf.name_scope("error_feedback"):
            new_residual = ops.sparse_accumulate(-sent, indices, length, out=acc)
            if stored != length:
                new_residual = tf.pad(new_residual, [[0, stored - length]])
            updates = self._memory.updates(name, new_residual, residual_scale)
        self.last_indices = indices
        return values, indices, k, updates

    def _exchange(self, values: tf.Tensor, indices: tf.Tensor, k: Union[int, Sequence[int]],
                  process_set: hvd.ProcessSet, name: str) -> Tuple[tf.Tensor, tf.Tensor]:
        """All-gather of every member's pairs: k per member, or one k per member in order."""
        gathered = hvd.allgather(wire.pack(values, indices, self.wire_dtype), process_set=process_set, name=name)
        return wire.unpack(gathered, k, indices.dtype)

    @staticmethod
    def _finite(values: tf.Tensor) -> tf.Tensor:
        """Whether every exchanged value is finite: identical on every rank (all hold the
        same pairs), and a check of the m n k pairs instead of the d-vector. MSTopK ranks
        Inf and NaN above every finite magnitude, so a non-finite entry anywhere in a rank's
        error-feedback buffer is always among the values it sends. (Finite values whose sum
        overflows float32 are the one case this passes: the output then holds Inf for the
        loss scaler, and the residuals committed are finite.)"""
        with tf.name_scope("finite"):
            return tf.reduce_all(tf.math.is_finite(values))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(density={self.density}, num_samplings={self.num_samplings}, "
                f"wire_dtype={self.wire_dtype.name})")
