"""What every gradient aggregation strategy shares: the call contract and its result.

A strategy is called on one fused 1-D gradient buffer of d elements (the same d on every
rank) and returns the average of all ranks' buffers, as seen through the strategy's
compression. Collective: every rank calls the same strategy on the same buffers, in the
same order. Sparse strategies keep error-feedback residuals (`hvdx.comm.memory`).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from hvdx.topology import Topology, topology

__all__ = ["Aggregated", "Strategy", "check_density", "node_reduce_scatter", "node_reduce_scatter_parts",
           "padded_length"]


def check_density(density: float) -> float:
    """A density in (0, 1], as a float (NumPy numbers too); ValueError otherwise."""
    if isinstance(density, bool) or not isinstance(density, numbers.Real) or not 0 < float(density) <= 1:
        raise ValueError(f"density must be a number in (0, 1], got {density!r}")
    return float(density)


def padded_length(d: int, parts: int) -> int:
    """d rounded up to a multiple of `parts`: buffers are zero-padded so that the node's
    ranks own equal slices (padding is never sent by sparse strategies: it stays zero)."""
    return -(-d // parts) * parts


def node_reduce_scatter_parts(padded: tf.Tensor, topo: Topology, name: str) -> List[tf.Tensor]:
    """Tensors whose sum is the node's sum of this rank's slice of `padded` (shi2021 eq. 4).

    `padded`'s length is a multiple of local_size n; slice j belongs to the j-th rank of the
    node-local set. Under Gloo, Horovod 0.28's reducescatter is 3-5x slower than the
    alternatives, so the node runs an all-to-all instead (rank j receives every rank's
    slice j: the (n-1)/n d elements of eq. 7, half what an allreduce moves) and the n
    slices are returned, for the caller to add in the pass it makes anyway (HiTopK adds
    its residual in the same one). Measured on the emulated 2 x 2 cluster, 25M floats:
    all-to-all + sum 0.15 s, allreduce + slice 0.25 s, reducescatter 0.79 s.
    Elsewhere (MPI, NCCL) the native reducescatter runs and gives one part.
    """
    import horovod.tensorflow as hvd

    n = topo.local_size
    if n == 1:
        return [padded]
    if not hvd.gloo_enabled():
        return [hvd.reducescatter(padded, op=hvd.Sum, process_set=topo.local_set, name=f"{name}.rs")]
    received = hvd.alltoall(padded, process_set=topo.local_set, name=f"{name}.a2a")
    return tf.unstack(tf.reshape(received, [n, int(padded.shape[0]) // n]))  # views, no copies


def node_reduce_scatter(padded: tf.Tensor, topo: Topology, name: str) -> tf.Tensor:
    """The node's sum of this rank's slice of `padded` (see `node_reduce_scatter_parts`)."""
    parts = node_reduce_scatter_parts(padded, topo, name)
    return parts[0] if len(parts) == 1 else tf.add_n(parts)


@dataclass
class Aggregated:
    """What one strategy call leaves behind (graph tensors of the current trace).

    output: the averaged buffer (length d), identical on every rank.
    updates: residual writes not yet made, (variable, new value) pairs: the caller makes
      them only if the step's averaged gradients are finite (`hvdx.comm.memory.commit`).
    local_slice: (this rank's averaged slice of the buffer, its offset) where the strategy
      reduce-scatters inside the node (2DTAR, HiTopK): LARS/LAMB compute their partial
      norms on it instead of another pass over d (shi2021 sec. 4.2).
    """

    output: tf.Tensor
    updates: List[Tuple[tf.Variable, tf.Tensor]] = field(default_factory=list)
    local_slice: Optional[Tuple[tf.Tensor, int]] = None


class Strategy:
    """Base of the aggregation strategies: `strategy(buffer, name) -> averaged buffer`.

    `aggregate(buffer, name, residual_scale)` is the two-phase form the aggregator uses:
    it returns an `Aggregated` whose residual updates the caller commits once it knows the
    whole step is finite. Calling the strategy directly commits them at once when the
    output is finite (a non-finite step leaves every residual as it was).
    """

    #: The name `hvdx.comm.get` knows the strategy by.
    key: str = ""
    #: Whether the strategy keeps error-feedback residuals (sparse) or is exact (dense).
    lossy: bool = False

    def __init__(self, topo: Optional[Topology] = None) -> None:
        self._topo = topo

    @property
    def topology(self) -> Topology:
        return self._topo or topology()

    def __call__(self, buffer: tf.Tensor, name: str = "grads") -> tf.Tensor:
        from hvdx.comm.memory import commit

        result = self.aggregate(self._check(buffer), name)
        if result.updates:
            with tf.control_dependencies([commit(result.updates, tf.reduce_all(tf.math.is_finite(result.output)))]):
                return tf.identity(result.output)
        return result.output

    @staticmethod
    def _check(buffer: tf.Tensor) -> tf.Tensor:
        buffer = tf.convert_to_tensor(buffer)
        if buffer.shape.rank != 1 or buffer.shape[0] is None:
            raise ValueError(f"a strategy takes a 1-D buffer of known length, got {buffer.shape}")
        return buffer

    def aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None) -> Aggregated:
        """Averages `buffer` over all ranks. `residual_scale` multiplies stored residuals
        before use (the loss scale changed since they were stored)."""
        raise NotImplementedError

    def create_state(self, name: str, d: int) -> None:
        """Creates the state (residuals) of buffer `name` of length d before the first call,
        so that a checkpoint or a saved model restores into it at once."""

    def signature(self) -> Dict[str, str]:
        """What every rank must agree on (checked once per layout by the aggregator)."""
        return {"strategy": repr(self)}

    @property
    def memory(self):
        """The strategy's `ResidualMemory` (sparse strategies), else None."""
        return None

    @property
    def variables(self) -> Dict[str, tf.Variable]:
        """The strategy's residuals by buffer name; empty for dense strategies."""
        return self.memory.variables_by_name if self.memory is not None else {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
