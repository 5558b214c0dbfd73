"""The dense baseline: Horovod's allreduce of each gradient, exactly `hvd.DistributedOptimizer`'s."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx.comm import wire
from hvdx.comm.base import Aggregated, Strategy
from hvdx.comm.registry import register
from hvdx.topology import Topology

__all__ = ["Allreduce", "OP_NAMES"]

#: Horovod's reduction ops by name (configs store the name).
OP_NAMES = {hvd.Average: "Average", hvd.Sum: "Sum", hvd.Adasum: "Adasum"}


@register("allreduce", aliases=("dense",))
class Allreduce(Strategy):
    """The dense baseline: Horovod's allreduce over the job's ranks, of each gradient as it
    is (exactly what `hvd.DistributedOptimizer` does with the same options: Horovod's
    background thread fuses the gradients that are ready; a grouped allreduce for
    Horovod's `groups` / `num_groups`).

    Args:
      op: hvd.Average (default), hvd.Sum or hvd.Adasum.
      prescale_factor, postscale_factor: Horovod's scaling around the reduction.
      process_set: the ranks that take part (default: all).
      compression: a Horovod compressor (hvd.Compression.fp16, ...); or `wire_dtype`,
        the type the buffer travels in (cast there and back).
    """

    options = ("op", "prescale_factor", "postscale_factor", "process_set", "compression", "wire_dtype")
    sends_pieces_apart = True

    def __init__(self, op=hvd.Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                 process_set: hvd.ProcessSet = hvd.global_process_set, compression=None,
                 wire_dtype=None, topo: Optional[Topology] = None) -> None:
        super().__init__(topo)
        if op not in OP_NAMES:
            raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}")
        if compression is not None and wire_dtype is not None:
            raise ValueError("give compression= or wire_dtype=, not both")
        self.op, self.prescale_factor, self.postscale_factor = op, float(prescale_factor), float(postscale_factor)
        self.process_set = process_set
        self.compression = compression
        self.wire_dtype = None if wire_dtype is None else wire.check_dtype(wire_dtype)

    def _aggregate(self, buffer: tf.Tensor, name: str, residual_scale=None) -> Aggregated:
        sent, ctx = buffer, None
        if self.compression is not None:
            sent, ctx = self.compression.compress(buffer)
        elif self.wire_dtype is not None and self.wire_dtype != buffer.dtype:
            sent = tf.cast(buffer, self.wire_dtype)
        total = hvd.allreduce(sent, op=self.op, prescale_factor=self.prescale_factor,
                              postscale_factor=self.postscale_factor, process_set=self.process_set,
                              name=f"hvdx.allreduce.{name}")
        if self.compression is not None:
            total = self.compression.decompress(total, ctx)
        return Aggregated(tf.cast(total, buffer.dtype))

    def _aggregate_pieces(self, pieces: Sequence[tf.Tensor], name: str, residual_scale=None, grouped: bool = False,
                          shapes=None) -> Tuple[List[tf.Tensor], Aggregated]:
        """The pieces as they are, as `hvd.DistributedOptimizer` hands its gradients to
        Horovod: one allreduce each, which Horovod's background thread fuses with whatever
        else is ready in its cycle, so a gradient's allreduce starts as soon as it exists
        (while backpropagation of earlier layers goes on) and the step makes no fused copy
        and no split of its own. `grouped` (Horovod's groups / num_groups): one grouped
        allreduce of the pieces, negotiated once all of them exist, as Horovod does."""
        pieces = list(pieces)
        if len(pieces) == 1 or self.op == hvd.Adasum:  # Adasum combines whole buffers
            return super()._aggregate_pieces(pieces, name, residual_scale)
        sent, contexts = pieces, [None] * len(pieces)
        if self.compression is not None:
            sent, contexts = zip(*(self.compression.compress(p) for p in pieces))
        elif self.wire_dtype is not None:
            sent = [tf.cast(p, self.wire_dtype) for p in pieces]
        options = dict(op=self.op, prescale_factor=self.prescale_factor, postscale_factor=self.postscale_factor,
                       process_set=self.process_set)
        if grouped:
            totals = hvd.grouped_allreduce(list(sent), name=f"hvdx.allreduce.{name}", **options)
        else:
            totals = [hvd.allreduce(s, name=f"hvdx.allreduce.{name}.{j}", **options) for j, s in enumerate(sent)]
        if self.compression is not None:
            totals = [self.compression.decompress(t, c) for t, c in zip(totals, contexts)]
        return [tf.cast(t, p.dtype) for t, p in zip(totals, pieces)], Aggregated(None)

    def __repr__(self) -> str:
        options = [f"op={OP_NAMES[self.op]}"]
        if self.prescale_factor != 1.0 or self.postscale_factor != 1.0:
            options.append(f"prescale={self.prescale_factor}, postscale={self.postscale_factor}")
        if self.process_set is not hvd.global_process_set:
            options.append(f"process_set={self.process_set.process_set_id}")
        if self.compression is not None:
            options.append(f"compression={getattr(self.compression, '__name__', type(self.compression).__name__)}")
        if self.wire_dtype is not None:
            options.append(f"wire_dtype={self.wire_dtype.name}")
        return f"Allreduce({', '.join(options)})"
