"""NaiveAG: the sparse all-gather baseline of shi2021 (eq. 3)."""
from __future__ import annotations

from typing import Optional

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import ops
from hvdx.comm.base import Aggregated
from hvdx.comm.registry import register
from hvdx.comm.sparse import TopKStrategy

__all__ = ["SparseAllgather"]


@register("sparse_allgather", aliases=("naiveag",))
class SparseAllgather(TopKStrategy):
    """NaiveAG: MSTopK on the whole buffer, all-gather of (value, index) pairs over all
    ranks, sparse accumulation. Every rank sends 2k elements to every other (eq. 3)."""


    def _sparse_aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None) -> Aggregated:
        topo = self.topology
        d = int(buffer.shape[0])
        chosen = self._select([buffer], name, residual_scale)
        values, indices = self._exchange(chosen.values, chosen.indices, chosen.k, hvd.global_process_set,
                                         f"hvdx.naiveag.ag.{name}", packet=chosen.packet)
        values = values / tf.cast(topo.size, values.dtype)
        return Aggregated(ops.sparse_accumulate(values, indices, d), chosen.updates, finite=self._finite(values))
