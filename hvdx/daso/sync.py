"""DASO's global synchronisation: what moves parameters between nodes (coquelin2021, sec. 3).

One rank per node, the members of one group (a cross set: the ranks of one local rank),
averages the parameters over the nodes (Figure 3); each member then sends the result to
the other ranks of its node, which replace theirs (Figure 4). Three kinds:

- blocking (warm-up, cool-down): 16-bit on the wire (bfloat16 by default) while the
  float32 master weights stay exact. What travels is each node's change since the last
  synchronisation, x_i - x_ref, rounded to 16 bits; every rank adds the float32 sum of
  the rounded changes to the float32 x_ref it holds, identical everywhere. Rounding thus
  touches one step's update (relative error 2^-8 of the update in bfloat16), never the
  weights themselves, and every node ends up with bit-identical parameters. float16
  changes are scaled by a power of two per member (sent beside them) so small updates do
  not underflow. Horovod has no bfloat16 sum on CPU, and a sum in 16 bits would round at
  every addition: the members all-gather the 16-bit changes and sum them in float32.
- non-blocking (cycling): the members start a float32 sum (the paper: casting delays the
  start and is not worth it here) on hvdx's own transport, whose thread moves the bytes
  while training goes on; `merge` later applies eq. 1,
  x = (2S x_local + sum_i x_i) / (2S + P), S the staleness in steps, P the group size.
  x_local is the state after the S-th local step since the exchange started, x^l_{t+S}
  where eq. 1 writes x^l_{t+S-1}: the paper's own expansion of the merge into gradients
  (supplement, eq. 6) counts S local steps, sum_{k=0}^{S-1} G_l(x_{l:t+k}), which is
  x^l_{t+S} by eq. 3; read literally, eq. 1 would drop the last local update (with S = 1,
  every local update made while the exchange was in flight).
- full average (drain): a float32 average over all nodes; afterwards every rank holds
  the same parameters, and they become the x_ref of the next blocking phase.

Only the trainable variables given to the optimizer are averaged. Optimizer slots
(momentum, Adam's moments) stay local, as in HeAT: they are running averages of each
node's own gradients, and averaging them would double the traffic. With SGD (momentum
included) an average after every step then equals synchronous data parallelism exactly,
since parameters and momenta are linear in the gradients.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Deque, Dict, Optional, Sequence

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdx import progress
from hvdx.comm import wire

from hvdx.topology import Topology

if TYPE_CHECKING:  # the transport opens sockets: imported where a DASO run sets up
    from hvdx.transport.ring import GroupTransport, Request

__all__ = ["FlatParameters", "ParameterSync", "SyncStats"]


class FlatParameters:
    """Reads and writes a list of variables as one flat float32 vector (one pass each way)."""

    def __init__(self, variables: Sequence[tf.Variable]) -> None:
        variables = list(variables)
        if not variables:
            raise ValueError("DASO has no variables to synchronise (no trainable variable got a gradient)")
        for v in variables:
            if v.dtype not in (tf.float32, tf.float16, tf.bfloat16):
                raise ValueError(f"DASO averages float32 (or 16-bit) parameters; {v.name} is {v.dtype.name}")
        self.variables = variables
        self.sizes = [int(np.prod(v.shape)) for v in variables]
        self.size = int(sum(self.sizes))
        self._read = tf.function(self._read_graph, autograph=False)
        self._write = tf.function(self._write_graph, autograph=False,
                                  input_signature=[tf.TensorSpec([self.size], tf.float32)])

    def _read_graph(self):
        return tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in self.variables], 0)

    def _write_graph(self, flat):
        for v, piece in zip(self.variables, tf.split(flat, self.sizes)):
            v.assign(tf.cast(tf.reshape(piece, v.shape), v.dtype))

    def read(self) -> np.ndarray:
        return self._read().numpy()

    def write(self, flat: np.ndarray) -> None:
        self._write(tf.convert_to_tensor(flat, tf.float32))


@dataclass
class _InFlight:
    group: int
    request: Optional["Request"]  # None on the ranks outside the group
    started_step: int


def _recent() -> Deque[float]:
    return collections.deque(maxlen=10_000)


@dataclass
class SyncStats:
    """What the synchronisations cost, in seconds on this rank (the last 10,000 of each kind;
    benchmarks read it)."""

    blocking: Deque[float] = field(default_factory=_recent)
    start: Deque[float] = field(default_factory=_recent)
    merge: Deque[float] = field(default_factory=_recent)
    merge_wait: Deque[float] = field(default_factory=_recent)
    full: Deque[float] = field(default_factory=_recent)
    exchange: Deque[float] = field(default_factory=_recent)  # a non-blocking request's own duration

    def __call__(self) -> Dict[str, Dict[str, float]]:
        """The summary (DASO's lifecycle `stats()`): per kind, how many were recorded (of the
        last 10,000) and their seconds in total."""
        return {kind: {"count": len(values), "seconds": float(sum(values))}
                for kind, values in ((f.name, getattr(self, f.name)) for f in fields(self))}


class ParameterSync:
    """Moves the parameters of one model between the nodes (the three kinds above).

    Collective in the node: every rank of a node calls the same methods at the same step
    (the schedule tells them); the transport is only used by the group's members.
    """

    def __init__(self, params: FlatParameters, topology: Topology, transport: "GroupTransport",
                 wire_dtype: str = "bfloat16") -> None:
        self.params = params
        self.topology = topology
        self.transport = transport
        self.wire_dtype = wire.check_dtype(wire_dtype, "blocking_wire_dtype")
        self.group_size = topology.num_nodes
        self.reference: Optional[np.ndarray] = None
        self.in_flight: Optional[_InFlight] = None
        self.stats = SyncStats()
        self._build_blocking()

    # -- helpers ---------------------------------------------------------------------
    def is_member(self, group: int) -> bool:
        """Whether this rank belongs to `group` (its local rank); ValueError for a group this
        topology does not have (a schedule planned for more ranks per node)."""
        if not 0 <= group < self.topology.local_size:
            raise ValueError(f"DASO group {group} does not exist with {self.topology.local_size} ranks per node "
                             "(the schedule was planned for another topology)")
        return self.topology.local_rank == group

    def _node_update(self, group: int, flat: Optional[np.ndarray]) -> np.ndarray:
        """Figure 4: the group's member sends `flat` to the other ranks of its node."""
        if self.topology.local_size == 1:
            return flat
        if flat is None:
            flat = np.empty(self.params.size, np.float32)  # only its shape matters off the root
        # Horovod's root_rank is a global rank, also inside a process set
        out = hvd.broadcast(tf.convert_to_tensor(flat), root_rank=self.topology.local_ranks[group],
                            name="hvdx.daso.node_update",
                            process_set=self.topology.local_set)
        return out.numpy()

    def set_reference(self, flat: np.ndarray) -> None:
        """x_ref := `flat`, the parameters every rank holds (after the initial broadcast or a drain)."""
        self.reference = flat

    # -- blocking ---------------------------------------------------------------------
    def blocking(self, group: int) -> None:
        """Averages in `group` now: 16-bit changes on the wire, float32 master weights."""
        with progress.waiting("daso", "global synchronisation (blocking)"):
            t0 = time.perf_counter()
            if self.reference is None:
                raise RuntimeError("the parameters' reference is not set (broadcast or drain first)")
            flat = None
            if self.is_member(group):
                if self.wire_dtype == tf.float16 and self.group_size > 1:  # scaled per member: numpy
                    change = self._average_float16_changes(self.params.read() - self.reference)
                    flat, finite = self.reference + change, bool(np.isfinite(change).all())
                    self.params.write(flat)
                else:  # bfloat16 / float32: cast and apply in TensorFlow (multi-threaded, one pass each)
                    reference = tf.constant(self.reference)
                    change = self._changes(reference).numpy()
                    if self.group_size == 1:
                        gathered = change[None]
                    elif self.wire_dtype == tf.float32:
                        gathered = self.transport.allreduce_sum(change).wait()[None]
                    else:
                        gathered = np.stack(self.transport.allgather(change).wait())
                    new, finite = self._apply_changes(reference, tf.constant(gathered))
                    flat, finite = new.numpy(), bool(finite)
                if not finite:
                    raise FloatingPointError(
                        "DASO's global average of the parameter changes is not finite (a rank's update "
                        "diverged); lower the learning rate or use a LossScaleOptimizer with mixed precision")
                flat = self._node_update(group, flat)
            else:
                flat = self._node_update(group, None)
                self.params.write(flat)
            self.reference = flat
            self.stats.blocking.append(time.perf_counter() - t0)

    def _build_blocking(self) -> None:
        """The TensorFlow passes of the averages (traced once per model)."""
        on_wire = self.wire_dtype
        size, divisor = self.params.size, float(self.group_size)
        params = self.params

        @tf.function(input_signature=[tf.TensorSpec([size], tf.float32)], autograph=False)
        def changes(reference):
            return tf.cast(params._read_graph() - reference, on_wire)

        @tf.function(input_signature=[tf.TensorSpec([size], tf.float32), tf.TensorSpec([None, size], on_wire)],
                     autograph=False)
        def apply_changes(reference, gathered):
            pieces = tf.unstack(tf.cast(gathered, tf.float32), num=1 if on_wire == tf.float32 else self.group_size)
            total = pieces[0]
            for piece in pieces[1:]:  # in member order on every member: identical sums
                total = total + piece
            mean = total / divisor
            new = reference + mean
            params._write_graph(new)
            return new, tf.reduce_all(tf.math.is_finite(mean))

        @tf.function(input_signature=[tf.TensorSpec([size], tf.float32), tf.TensorSpec([], tf.float32),
                                      tf.TensorSpec([], tf.float32)], autograph=False)
        def blend(total, weight, divisor):
            """x := (weight x + total) / divisor: eq. 1 with weight 2S and divisor 2S + P;
            the plain average with weight 0 and divisor P."""
            new = (weight * params._read_graph() + total) / divisor
            params._write_graph(new)
            return new

        self._changes, self._apply_changes, self._blend = changes, apply_changes, blend

    def _average_float16_changes(self, change: np.ndarray) -> np.ndarray:
        """float16 changes, each member's scaled by its own power of two (its exponent sent
        beside them, `hvdx.comm.wire.to_wire` with upscale) so that small updates do not
        underflow; summed in float32 in member order."""
        scaled, e = wire.to_wire(tf.constant(change), tf.float16, upscale=True)
        exponents = self.transport.allgather(np.array([e.numpy()], np.float32))
        pieces = self.transport.allgather(scaled.numpy()).wait()
        total = np.zeros_like(change)
        for piece, exponent in zip(pieces, exponents.wait()):
            total += piece.astype(np.float32) * np.float32(2.0 ** exponent[0])
        return total / np.float32(self.group_size)

    # -- non-blocking -----------------------------------------------------------------
    def start(self, group: int, step: int) -> None:
        """Starts the float32 sum of this step's parameters in `group`; training goes on."""
        if self.in_flight is not None:
            raise RuntimeError("a global exchange is already in flight")
        t0 = time.perf_counter()
        request = None
        if self.is_member(group) and self.group_size > 1:
            request = self.transport.allreduce_sum(self.params.read())
        self.in_flight = _InFlight(group, request, step)
        self.stats.start.append(time.perf_counter() - t0)

    def merge(self, staleness: int) -> None:
        """Eq. 1 on the group's members, then the node update (Figure 4) on every rank."""
        with progress.waiting("daso", "global synchronisation (merge)"):
            if self.in_flight is None:
                raise RuntimeError("no global exchange is in flight")
            if staleness < 0:
                raise ValueError(f"staleness must be >= 0 steps, got {staleness}")
            in_flight, self.in_flight = self.in_flight, None
            t0 = time.perf_counter()
            if self.is_member(in_flight.group) and in_flight.request is not None:
                total = in_flight.request.wait()
                self.stats.merge_wait.append(time.perf_counter() - t0)
                if in_flight.request.finished is not None:
                    self.stats.exchange.append(in_flight.request.finished - in_flight.request.started)
                two_s = 2.0 * staleness
                flat = self._blend(tf.constant(total), two_s, two_s + self.group_size).numpy()
                self._node_update(in_flight.group, flat)
            else:
                self._receive(in_flight.group)
            self.stats.merge.append(time.perf_counter() - t0)

    def _receive(self, group: int) -> np.ndarray:
        """Off the group (or with nothing to merge): take the member's parameters."""
        flat = self._node_update(group, None if not self.is_member(group) else self.params.read())
        if not self.is_member(group):
            self.params.write(flat)
        return flat

    # -- drain -------------------------------------------------------------------------
    def average(self, group: int) -> None:
        """A float32 average over the nodes, then the node update: all ranks identical."""
        with progress.waiting("daso", "global synchronisation (average)"):
            if self.in_flight is not None:
                raise RuntimeError("merge the exchange in flight before a full average")
            t0 = time.perf_counter()
            if self.is_member(group) and self.group_size > 1:
                total = self.transport.allreduce_sum(self.params.read()).wait()
                flat = self._blend(tf.constant(total), 0.0, float(self.group_size)).numpy()
                self._node_update(group, flat)
            else:
                flat = self._receive(group)
            self.reference = flat
            self.stats.full.append(time.perf_counter() - t0)
