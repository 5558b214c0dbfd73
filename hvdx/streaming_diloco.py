"""Streaming DiLoCo: DiLoCo's outer step taken one fragment of the model at a time, each
fragment's exchange overlapped with the next inner steps, and the outer gradients low-bit
across nodes (Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", 2025, arXiv 2501.18512: sec. 2.2 streaming partial updates, 2.3
overlapping communication, 2.4 quantized outer gradients).

The trainable variables are dealt into P fragments. Fragment p is synchronised every H
(`sync_every`) local steps, at an offset: after local step s with s mod H = t_p, t_p =
((p + 1) H / P) mod H, so the fragments take turns and the peak bandwidth is 1/P of DiLoCo's.
At its turn, on every rank m (DiLoCo Alg. 1 lines 8-12 on the fragment):

    delta_p = x_anchor,p - mean over ranks of x^m_p         (outer gradient, exchanged in the background)
    ... tau (`overlap`) more inner steps while it travels ...
    x_anchor,p <- outer_optimizer.apply(delta_p, x_anchor,p)
    x^m_p <- alpha x^m_p + (1 - alpha) x_anchor,p               (the merge, sec. 2.3; alpha = `mixing`)

With P = 1, tau = 0 and alpha = 0 this is `hvdx.localsgd.LocalSGD`. The exchange runs on
hvdx's own transport (`hvdx.transport.ring`, on a thread of its own, so the inner steps go on
while it travels; Horovod's TF collectives would block). On a 2-tier job it is hierarchical:
an exact node-local sum of the outer gradients (the node is one DiLoCo replica), then, for
each local rank's 1/n slice, the sum across nodes in its cross set, 32-bit, or 8- / 4-bit
with a float32 scale per chunk (`hvdx.comm.wire.quantize`; all-gathered, as integers of
several nodes cannot be summed on the wire, and summed in one order on every member), then
a node all-gather of the slices. Every rank ends each exchange with the same bits, so the
anchors (and the outer optimizer's state) stay identical on every rank.

    model.compile(tf.keras.optimizers.AdamW(1e-3), loss)                  # the plain optimizer
    model.fit(x_shard, y_shard, epochs=10, callbacks=[hvdx.callbacks.TrainingMethodCallback(
        hvdx.streaming_diloco.StreamingDiLoCo(sync_every=30, fragments=3, overlap=1, bits=4))])
"""
from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from typing import Any, Deque, Dict, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvdx.arguments import integer, real
from hvdx.comm.base import check_hierarchical
from hvdx.comm.wire import DEFAULT_CHUNK, check_bits, check_chunk, dequantize, quantize
from hvdx.localsgd import LocalSGD
from hvdx.topology import Topology, topology as current_topology
from hvdx.transport.base import TransportError
from hvdx.transport.ring import GroupTransport

__all__ = ["OuterExchange", "StreamingDiLoCo", "plan_fragments"]


def plan_fragments(sizes: Sequence[int], fragments: int) -> List[List[int]]:
    """Deals variables of `sizes` elements into `fragments` groups of near-equal size: the
    largest first, each to the group with the fewest elements so far (ties: the lower group).

    Returns the groups' variable indices, each ascending; the same on every rank for the same
    sizes. Raises ValueError: fewer variables than `fragments` (a group would be empty).
    """
    fragments = integer(fragments, "fragments", 1)
    if len(sizes) < fragments:
        raise ValueError(f"fragments={fragments} needs at least as many trainable variables; the model has "
                         f"{len(sizes)} (pass fragments={max(1, len(sizes))} or fewer)")
    totals = [0] * fragments
    groups: List[List[int]] = [[] for _ in range(fragments)]
    for index in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        lightest = min(range(fragments), key=lambda g: (totals[g], g))
        groups[lightest].append(index)
        totals[lightest] += int(sizes[index])
    return [sorted(g) for g in groups]


class OuterExchange:
    """The mean over all ranks of a float32 vector, computed on a thread of its own over
    hvdx's ring transport: exact within a node, then 32-, 8- or 4-bit across nodes
    (module docstring); the same bits on every rank.

    Build it collectively (`OuterExchange.create`); `submit(x, key)` returns a Future of the
    mean; submissions run in order and every rank must submit the same lengths in the same
    order. With `error_feedback` and low bits, what the wire rounded away from this rank's
    slice is added to the next submission of the same `key` (SparseLoCo's error feedback on
    outer gradients; kept in memory, not in checkpoints). `bytes_sent` counts what this rank
    sent: {"node": ..., "cross": ...}.
    """

    def __init__(self, node: Optional[GroupTransport], cross: GroupTransport, local_rank: int, local_size: int,
                 size: int, bits: Optional[int], chunk: int, timeout: float, error_feedback: bool = True) -> None:
        self.node, self.cross = node, cross
        self.local_rank, self.local_size, self.size = local_rank, local_size, size
        self.bits, self.chunk, self.timeout = bits, chunk, timeout
        self.error_feedback = error_feedback
        self.residuals: Dict[Any, np.ndarray] = {}  # these three: written by the worker thread only
        self.bytes_sent = {"node": 0, "cross": 0}
        self.seconds = 0.0
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvdx-outer-exchange")

    @classmethod
    def create(cls, topology: Topology, *, bits: Optional[int], chunk: int, hierarchical: bool, timeout: float,
               name: str, error_feedback: bool = True) -> "OuterExchange":
        """Collective over all ranks: one ring per node and one per cross set where
        `hierarchical` (and the job has 2 tiers), else one ring over all ranks."""
        if hierarchical and topology.two_tier:
            node = GroupTransport.create(topology.node_ranks, topology.rank, name=f"{name}.node", timeout=timeout)
            cross_sets = [[ranks[l] for ranks in topology.node_ranks] for l in range(topology.local_size)]
            cross = GroupTransport.create(cross_sets, topology.rank, name=f"{name}.cross", timeout=timeout)
            return cls(node, cross, topology.local_rank, topology.local_size, topology.size, bits, chunk, timeout,
                       error_feedback)
        cross = GroupTransport.create([list(range(topology.size))], topology.rank, name=f"{name}.all",
                                      timeout=timeout)
        return cls(None, cross, 0, 1, topology.size, bits, chunk, timeout, error_feedback)

    def submit(self, x: np.ndarray, key: Any = None) -> "concurrent.futures.Future[np.ndarray]":
        """A Future of the mean over ranks of the 1-D float32 `x` (not modified; copied);
        `key` names the vector whose rounding error the next submission of it carries."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1).copy()
        return self._worker.submit(self._mean, x, key)

    def _wait(self, request: Any, what: str) -> Any:
        try:
            return request.wait(self.timeout)
        except TimeoutError as exc:
            raise TransportError(f"the outer exchange's {what} was not done within {self.timeout} s") from exc

    def _mean(self, x: np.ndarray, key: Any) -> np.ndarray:
        began = time.perf_counter()
        try:
            return self._exchange(x, key)
        finally:
            self.seconds += time.perf_counter() - began

    def _exchange(self, x: np.ndarray, key: Any) -> np.ndarray:
        length = x.size
        align = self.chunk if self.bits is not None else 1
        slice_length = -(-max(length, 1) // (self.local_size * align)) * align
        padded = np.zeros(slice_length * self.local_size, np.float32)
        padded[:length] = x
        if self.node is not None:
            padded = self._wait(self.node.allreduce_sum(padded), "node-local sum")
            self._count("node", 2 * (self.local_size - 1) * slice_length * 4)
        own = padded[self.local_rank * slice_length:(self.local_rank + 1) * slice_length]
        summed = self._cross_sum(np.ascontiguousarray(own), key)
        if self.node is not None:
            pieces = self._wait(self.node.allgather(summed), "node-local all-gather")
            self._count("node", (self.local_size - 1) * summed.nbytes)
            summed = np.concatenate(pieces)
        return summed[:length] / np.float32(self.size)

    def _cross_sum(self, piece: np.ndarray, key: Any) -> np.ndarray:
        members = self.cross.size
        if self.bits is None:
            self._count("cross", 2 * (members - 1) * piece.nbytes // max(members, 1))
            return self._wait(self.cross.allreduce_sum(piece), "sum across nodes")
        residual = self.residuals.get(key) if self.error_feedback else None
        if residual is not None and residual.shape == piece.shape:
            piece = piece + residual
        packed, sent = quantize(tf.constant(piece), self.bits, self.chunk)
        if self.error_feedback:
            self.residuals[key] = piece - sent.numpy()
        packed = packed.numpy()
        self._count("cross", (members - 1) * packed.nbytes)
        rows = self._wait(self.cross.allgather(packed), "low-bit all-gather across nodes")
        total = np.zeros(piece.size, np.float32)
        for row in rows:  # member order: the same sum on every member
            total += dequantize(tf.constant(row), piece.size, self.bits, self.chunk).numpy()
        return total

    def _count(self, tier: str, nbytes: int) -> None:
        self.bytes_sent[tier] += int(nbytes)

    def close(self) -> None:
        """Closes the rings (a pending exchange fails) and the thread; no collective."""
        for ring in (self.node, self.cross):
            if ring is not None:
                ring.close()
        self._worker.shutdown(wait=False, cancel_futures=True)


class _InFlight(NamedTuple):
    fragments: List[int]
    apply_at: int
    mixing: float
    future: "concurrent.futures.Future[np.ndarray]"


class StreamingDiLoCo(LocalSGD):
    """Streaming DiLoCo (module docstring): LocalSGD whose outer step is taken by fragments in
    turn, overlapped, with low-bit outer gradients across nodes.

    Args:
      sync_every: H, local steps between two synchronisations of one fragment.
      outer_optimizer: as `LocalSGD`'s (default `default_outer_optimizer(optimizer)` at the
        first `start()`: the ranks' average over an inner optimizer with momentum, else
        DiLoCo's Nesterov SGD(0.7, momentum 0.9)); it is built on every anchor variable at `start()` and takes one step per fragment
        exchange (its `iterations` count fragment steps).
      fragments: P, the number of fragments (1 <= P <= H, at most the number of trainable
        variables; `plan_fragments` deals the variables).
      overlap: tau, inner steps taken while a fragment's exchange travels (0 <= tau < H; 0:
        blocking).
      mixing: alpha, the weight the local fragment keeps at the merge (default 0.5 where
        overlap > 0, else 0: the local fragment replaced by the anchor, as DiLoCo).
      bits: None (float32), 8 or 4: the outer gradients' width across nodes.
      chunk: elements per float32 scale of the low-bit wire (an even int >= 2).
      error_feedback: with low bits, each rank's rounding error of a fragment's outer gradient
        is added to that fragment's next one (`OuterExchange`); False: dropped, as the
        paper's quantized exchange.
      hierarchical: node-local exact sum first (default: on a 2-tier job).
      sync_every_epoch: at each epoch's end, finish the exchanges in flight and synchronise
        every fragment blocking (alpha = 0), so validation and checkpoints see one model on
        every rank; the fragments' schedule goes on by the step count.
      timeout: seconds a transfer may take before the exchange fails (TransportError).

    The lifecycle is LocalSGD's; `start()` also builds the transport (collective: two
    all-gathers of addresses); `finish()` waits for the exchanges in flight and synchronises
    every fragment (one model on every rank); `close()` / `reset()` drop the transport and
    the exchanges in flight without any collective. `state()` adds the options; exchanges in
    flight are not kept (a restored run starts from rank 0's model, as LocalSGD's).

    Raises ValueError: bad arguments (naming them), as LocalSGD's; TransportError: a peer
    died or stalled during an exchange (raised at the step that applies it).
    """

    label = "Streaming DiLoCo"

    def __init__(self, sync_every: int = 30, outer_optimizer: Any = None, *,
                 fragments: int = 3, overlap: int = 1, mixing: Optional[float] = None, bits: Optional[int] = None,
                 chunk: int = DEFAULT_CHUNK, error_feedback: bool = True, hierarchical: Optional[bool] = None,
                 sync_every_epoch: bool = True, timeout: float = 300.0) -> None:
        super().__init__(sync_every, outer_optimizer, sync_every_epoch=sync_every_epoch)
        self.fragments = integer(fragments, "fragments", 1, self.sync_every,
                                 expected=f"an int in [1, sync_every={self.sync_every}]")
        self.overlap = integer(overlap, "overlap", 0, self.sync_every - 1,
                               expected=f"an int in [0, sync_every - 1 = {self.sync_every - 1}] (inner steps)")
        default_mixing = 0.5 if self.overlap else 0.0
        self.mixing = default_mixing if mixing is None else real(mixing, "mixing", 0.0, 1.0)
        self.bits = check_bits(bits, optional=True)
        self.chunk = check_chunk(chunk)
        self.hierarchical = check_hierarchical(hierarchical)
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.timeout = real(timeout, "timeout", 0.0, low_open=True, expected="a positive number of seconds")
        self.groups: List[List[int]] = []
        self.exchange: Optional[OuterExchange] = None
        self.inflight: Deque[_InFlight] = deque()
        self._apply_fns: Dict[tuple, Any] = {}
        self._traced_outer: Any = None  # the outer optimizer _apply_fns were traced with
        self.waited_seconds = 0.0  # the training thread's wait for exchanges (what the overlap did not hide)

    # -- the lifecycle ----------------------------------------------------------------------
    def start(self, model_or_variables: Any, optimizer: Any = None, *, steps_per_epoch: Optional[int] = None,
              epochs: Optional[int] = None) -> "StreamingDiLoCo":
        """LocalSGD's start (rank 0's model everywhere, the anchor), the fragments planned and
        the transport (collective). Exchanges still in
        flight from before (a loop that starts again without `close()`) are waited for and
        dropped, on every rank alike. Returns self."""
        for item in self.inflight:
            item.future.result()
        self.inflight.clear()
        super().start(model_or_variables, optimizer)
        if not self.groups:
            self.groups = plan_fragments([int(np.prod(v.shape)) for v in self.variables], self.fragments)
        if self.exchange is None:
            topo = current_topology()
            hierarchical = topo.two_tier if self.hierarchical is None else self.hierarchical
            self.exchange = OuterExchange.create(topo, bits=self.bits, chunk=self.chunk, hierarchical=hierarchical,
                                                 timeout=self.timeout, name="hvdx.streaming_diloco",
                                                 error_feedback=self.error_feedback)
        return self

    def offset(self, fragment: int) -> int:
        """t_p: fragment p is exchanged after the local steps s with s mod H = t_p."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every

    def after_step(self) -> None:
        """Counts the step; launches the fragments whose turn it is, then applies the exchanges
        launched `overlap` steps ago (collective: every rank runs as many steps)."""
        if not self._started:
            raise RuntimeError("StreamingDiLoCo.after_step() needs start(model, optimizer) first (collective over "
                               "all ranks; again after reset())")
        self.steps += 1
        self.pending += 1
        due = [p for p in range(self.fragments) if self.steps % self.sync_every == self.offset(p)]
        for p in due:
            self._launch([p], self.steps + self.overlap, self.mixing)
        while self.inflight and self.inflight[0].apply_at <= self.steps:
            self._apply(self.inflight.popleft())

    def synchronize(self) -> None:
        """Collective, blocking: the exchanges in flight applied, then every fragment's outer
        step at once with alpha = 0, so every rank holds the anchor (one model)."""
        self.drain()
        self._launch(list(range(self.fragments)), self.steps, 0.0)
        self._apply(self.inflight.popleft())
        self.pending = 0

    def drain(self) -> None:
        """Waits for the exchanges in flight and applies them, in order."""
        while self.inflight:
            self._apply(self.inflight.popleft())

    def _launch(self, fragments: List[int], apply_at: int, mixing: float) -> None:
        indices = [i for p in fragments for i in self.groups[p]]
        anchor = self._anchor_values()
        deltas = [tf.reshape(tf.cast(anchor[i] - self.variables[i], tf.float32), [-1]) for i in indices]
        flat = tf.concat(deltas, 0).numpy()
        self.inflight.append(_InFlight(fragments, apply_at, mixing, self.exchange.submit(flat, tuple(fragments))))

    def _apply(self, item: _InFlight) -> None:
        began = time.perf_counter()
        try:
            mean = item.future.result()
        except concurrent.futures.CancelledError as exc:
            raise TransportError("the outer exchange was cancelled (the transport was closed)") from exc
        finally:
            self.waited_seconds += time.perf_counter() - began
        if self._traced_outer is not self.outer_optimizer:  # the first apply, or restore() gave a new one
            self._traced_outer = self.outer_optimizer  # (LocalSGD built it on every anchor)
            self._apply_fns.clear()
        offset = 0
        for p in item.fragments:
            sizes = [int(np.prod(self.variables[i].shape)) for i in self.groups[p]]
            deltas = tf.split(tf.constant(mean[offset:offset + sum(sizes)]), sizes)
            offset += sum(sizes)
            key = (p, item.mixing)
            if key not in self._apply_fns:
                self._apply_fns[key] = tf.function(
                    lambda ds, p=p, mixing=item.mixing: self._apply_graph(p, ds, mixing), autograph=False)
            self._apply_fns[key](list(deltas))
            self.outer_steps += 1

    def _apply_graph(self, fragment: int, deltas: List[tf.Tensor], mixing: float) -> None:
        indices = self.groups[fragment]
        anchors, values = [self.anchor[i] for i in indices], self._anchor_values()
        self.outer_optimizer.apply_gradients(
            [(tf.cast(tf.reshape(d, values[i].shape), values[i].dtype), a) for i, d, a in zip(indices, deltas, anchors)])
        for i in indices:  # after the outer step: ordered on the anchor's resource
            v, anchor = self.variables[i], tf.cast(values[i].read_value(), self.variables[i].dtype)
            v.assign(anchor if mixing == 0.0 else mixing * v + (1.0 - mixing) * anchor)

    def end_epoch(self, epoch: int, logs: Optional[Mapping[str, Any]]) -> None:
        """With `sync_every_epoch` and steps since the last full synchronisation:
        `synchronize()` (collective)."""
        if self.sync_every_epoch and self._started and (self.pending or self.inflight):
            self.synchronize()

    def finish(self) -> None:
        """Collective: every fragment synchronised, one model on every rank. Idempotent."""
        if self._started and (self.pending or self.inflight):
            self.synchronize()

    def close(self) -> None:
        """Drops the transport and the exchanges in flight (no collective); start() again."""
        self._started = False
        self.inflight.clear()
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None

    def reset(self, topology: Any = None) -> None:
        """The membership changed: `close()`; the counts stay; the next start() takes rank 0's
        model and builds the transport for the new ranks (collective)."""
        self.close()
        self.pending = 0

    # -- checkpoints and records ------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        """LocalSGD's state and the options: "fragments", "overlap", "mixing", "bits", "chunk",
        "error_feedback" (the residuals themselves are not kept)."""
        state = super().state()
        state.update(fragments=self.fragments, overlap=self.overlap, mixing=self.mixing, bits=self.bits,
                     chunk=self.chunk, error_feedback=self.error_feedback)
        return state

    def restore(self, state: Mapping[str, Any]) -> None:
        """Takes back a `state()`. Raises ValueError where its fragments or wire differ from
        this method's (the schedule and the anchors' planning would not match)."""
        for key in ("fragments", "bits", "chunk"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"this checkpoint's Streaming DiLoCo has {key}={state[key]!r}, this run "
                                 f"{key}={getattr(self, key)!r}: build StreamingDiLoCo({key}={state[key]!r})")
        super().restore(state)
        self.overlap = int(state.get("overlap", self.overlap))
        self.mixing = float(state.get("mixing", self.mixing))
        self.error_feedback = bool(state.get("error_feedback", self.error_feedback))

    def stats(self) -> Dict[str, Any]:
        """LocalSGD's stats, the fragments, the exchanges in flight, the bytes this rank sent
        ({"node", "cross"}), "exchange_seconds" (its exchange thread's time on them) and
        "waited_seconds" (the training thread's wait for them: the part the overlap did not
        hide)."""
        stats = super().stats()
        exchange = self.exchange
        stats.update(method=self.label, fragments=self.fragments, overlap=self.overlap, inflight=len(self.inflight),
                     bytes_sent=dict(exchange.bytes_sent) if exchange is not None else None,
                     exchange_seconds=exchange.seconds if exchange is not None else None,
                     waited_seconds=self.waited_seconds)
        return stats

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the interpreter may be shutting down
            pass
