"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): rank-r compression of each
matrix-shaped gradient by one step of power iteration, with warm start and error feedback.

For each gradient viewed as a matrix M (n x m: a kernel of shape [..., m] as
[prod(shape[:-1]), m]) and a Q (m x r) identical on every rank, Algorithm 1:

    P = M Q;  P <- mean over ranks;  P^ = orthogonalize(P);  Q = M^T P^;  Q <- mean over ranks

and the average of the ranks' M is approximated by P^ Q^T. Algorithm 2 (error feedback): M
is this step's gradient plus the rank's residual e, and e <- M - P^ (M^T P^)^T, the part of
M the rank's own approximation missed. Warm start (sec. 3): a step's Q is the previous
step's averaged Q (the first one drawn from a normal distribution, seeded by the buffer's
name, the same on every rank). A matrix whose compression would not pay (n m below
`min_compression` (n + m) r), and every 1-D or 0-D gradient, is averaged exactly, in the
same all-reduce as P.

Hierarchical (default on a 2-tier topology, several nodes of several ranks): the bucket's
gradients are dealt to the node's ranks (whole gradients, balanced by what each sends), a
node-local all-to-all sums each rank's share over the node exactly, each rank runs the
algorithm above on its share across nodes in its cross set (only P and Q cross the slow
links, each local rank's on its own stream), and a node-local all-gather of the factors
(P^, Q and the exact averages) lets every rank rebuild the whole bucket.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx.arguments import integer, real
from hvdx.comm.base import Aggregated, Shapes, Strategy, check_hierarchical
from hvdx.comm.memory import ResidualMemory
from hvdx.comm.registry import register
from hvdx.node.collectives import node_allgather

__all__ = ["DEFAULT_MIN_COMPRESSION", "DEFAULT_RANK", "PowerSGD", "matrix_view"]

#: The approximation's rank when none is given.
DEFAULT_RANK = 4
#: A matrix is compressed only where it sends at least this many times fewer elements (the
#: rule of PyTorch's PowerSGD hook, `min_compression_rate`).
DEFAULT_MIN_COMPRESSION = 2.0
#: The collective names of the state's agreement (`PowerSGD.agree_state`).
STEPS_AGREEMENT = "hvdx.powersgd.steps.agree"
Q_AGREEMENT = "hvdx.powersgd.q.agree"


def matrix_view(shape: Optional[Tuple[int, ...]]) -> Optional[Tuple[int, int]]:
    """The (rows, columns) PowerSGD sees a gradient of `shape` as: [prod(shape[:-1]),
    shape[-1]] (TensorFlow's kernels keep their outputs last); None for a 0-D or 1-D
    gradient, or an unknown shape (the piece of a split gradient)."""
    if shape is None or len(shape) < 2:
        return None
    return math.prod(int(n) for n in shape[:-1]), int(shape[-1])


@dataclass(frozen=True)
class _Item:
    """One piece of a bucket: its index and length, its matrix view (rows 0: averaged
    exactly), where its Q lies in the bucket's Q vector, and which local rank handles it."""

    index: int
    size: int
    rows: int
    cols: int
    q_offset: int
    owner: int


@dataclass(frozen=True)
class _Plan:
    """A bucket's items, its Q vector's length, and each local rank's share (item indices)."""

    items: Tuple[_Item, ...]
    q_length: int
    shares: Tuple[Tuple[int, ...], ...]

    def share_length(self, owner: int) -> int:
        return sum(self.items[i].size for i in self.shares[owner])


@register("powersgd")
class PowerSGD(Strategy):
    """PowerSGD (Vogels et al. 2019, Algorithms 1 and 2), hierarchical on a 2-tier topology.

    Args:
      rank: the approximation's rank r (default DEFAULT_RANK): P (n x r) and Q (m x r) are
        sent for an n x m matrix instead of its n m elements.
      min_compression: a matrix is compressed only where n m >= min_compression (n + m) r
        (default 2); the others are averaged exactly. Must be >= 1.
      start_step: the first this-many steps of each bucket are averaged exactly (PyTorch's
        `start_powerSGD_iter`); 0: compressed from the first step (the paper's setting).
      hierarchical: True: node-local exact sum, PowerSGD across nodes, node-local gather
        (needs the global process set); False: PowerSGD over all ranks of the process set;
        None (default): True where the job has several nodes of several ranks.
      process_set: the ranks that take part (default: all); another set runs flat.
    Raises:
      ValueError: a bad option, or hierarchical=True with a process set other than the
        global one.

    Needs each piece's shape (`aggregate_pieces(shapes=)`, which hvdx's optimizer and tape
    give): a buffer given without shapes is averaged exactly. Its state, per bucket: the
    residual (this rank's, `ResidualMemory`), Q (the same on every rank: broadcast from the
    set's first rank when ranks meet, `agree_state`) and a step counter; all are
    checkpointed with the optimizer and change only on finite steps.
    """

    lossy = True
    options = ("rank", "min_compression", "start_step", "hierarchical", "process_set")
    quiet_defaults = {"min_compression": DEFAULT_MIN_COMPRESSION, "start_step": 0, "hierarchical": None}

    def __init__(self, rank: int = DEFAULT_RANK, min_compression: float = DEFAULT_MIN_COMPRESSION,
                 start_step: int = 0, hierarchical: Optional[bool] = None,
                 process_set: hvd.ProcessSet = hvd.global_process_set, topo=None) -> None:
        super().__init__(topo)
        self.rank = integer(rank, "rank", 1, expected="an int >= 1 (the approximation's rank)")
        self.min_compression = real(min_compression, "min_compression", 1, expected="a number >= 1")
        self.start_step = integer(start_step, "start_step", 0, expected="an int >= 0 (steps averaged exactly)")
        if check_hierarchical(hierarchical) and process_set is not hvd.global_process_set:
            raise ValueError("PowerSGD(hierarchical=True) runs over the topology's node and cross sets, i.e. every "
                             "rank: drop process_set=, or use hierarchical=False to run flat over the set")
        self.hierarchical = hierarchical
        self.process_set = process_set
        self._memory = ResidualMemory(self.key)
        self._q = ResidualMemory(f"{self.key}_q", shared=True)
        self._plans: dict = {}

    # -- state ----------------------------------------------------------------------------
    @property
    def memory(self) -> ResidualMemory:
        return self._memory

    @property
    def memories(self) -> List[ResidualMemory]:
        """The residuals' memory and the warm-started Q's."""
        return [self._memory, self._q]

    @property
    def q_vectors(self) -> dict:
        """Each bucket's Q (its matrices' Q, m x r each, flattened end to end), by buffer name."""
        return self._q.variables_by_name

    def _tiers(self) -> Tuple[int, int, Any, int]:
        """(local ranks n, this rank's local rank, the cross set, ranks in all): the node tier
        when hierarchical, else one tier over the process set."""
        topo = self.topology
        auto = self.process_set is hvd.global_process_set and topo.two_tier
        if self.hierarchical or (self.hierarchical is None and auto):
            return topo.local_size, topo.local_set.rank(), topo.cross_set, topo.size
        ranks = self.process_set.size() if self.process_set is not hvd.global_process_set else topo.size
        return 1, 0, self.process_set, ranks

    def _plan(self, sizes: Sequence[int], shapes: Shapes, owners: int) -> _Plan:
        """The bucket's items (pieces with their matrix views) dealt to `owners` local ranks:
        largest first, each to the rank that sends least so far (the same on every rank)."""
        key = (tuple(sizes), None if shapes is None else tuple(shapes), owners)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        items, q_offset = [], 0
        for j, size in enumerate(sizes):
            view = matrix_view(None if shapes is None else shapes[j])
            rows = cols = 0
            if view is not None and view[0] * view[1] >= self.min_compression * (view[0] + view[1]) * self.rank:
                rows, cols = view
            items.append([j, size, rows, cols, q_offset if rows else -1])
            q_offset += cols * self.rank if rows else 0
        sent = [0] * owners
        owner_of = {}
        for j in sorted(range(len(items)), key=lambda j: (-items[j][1], j)):
            size, rows, cols = items[j][1:4]
            cost = (rows + cols) * self.rank if rows else size
            o = min(range(owners), key=lambda o: (sent[o], o))
            owner_of[j] = o
            sent[o] += cost
        built = tuple(_Item(*item, owner=owner_of[item[0]]) for item in items)
        shares = tuple(tuple(it.index for it in built if it.owner == o) for o in range(owners))
        plan = _Plan(built, q_offset, shares)
        self._plans[key] = plan
        return plan

    def create_state(self, name: str, d: int, shapes: Shapes = None) -> None:
        n, _, _, _ = self._tiers()
        sizes = [math.prod(s) for s in shapes] if shapes is not None and None not in shapes else None
        plan = self._plan(sizes if sizes is not None else [d], shapes if sizes is not None else None, n)
        self._memory.variable(name, max(plan.share_length(o) for o in range(n)), tf.float32)
        self._memory.counter(name)
        if plan.q_length:
            self._q.variable(name, plan.q_length, tf.float32)

    def agree_state(self, names: Sequence[str], process_set: hvd.ProcessSet) -> None:
        """Makes the step counters the largest over the ranks (they pick `start_step`'s
        exact steps) and every Q the one of the set's first rank (one eager broadcast): a
        returning node's new processes meet survivors that trained on (elastic reset)."""
        self._memory.agree_counters(names, process_set, STEPS_AGREEMENT)
        qs = [self.q_vectors[name] for name in names if name in self.q_vectors]
        with tf.init_scope():
            if qs:
                root = process_set.ranks[0] if process_set is not hvd.global_process_set else 0
                flat = tf.concat([q.read_value() for q in qs], axis=0)
                flat = hvd.broadcast(flat, root_rank=root, process_set=process_set, name=Q_AGREEMENT)
                for q, value in zip(qs, tf.split(flat, [int(q.shape[0]) for q in qs])):
                    q.assign(value)

    # -- the algorithm -------------------------------------------------------------------
    def _aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None) -> Aggregated:
        """A buffer without shapes: averaged exactly (one piece that is no matrix)."""
        (output,), result = self._aggregate_pieces([buffer], name, residual_scale)
        return Aggregated(output, result.updates, finite=result.finite)

    def _aggregate_pieces(self, pieces: List[tf.Tensor], name: str, residual_scale: Optional[tf.Tensor] = None,
                          grouped: bool = False, shapes: Shapes = None) -> Tuple[List[tf.Tensor], Aggregated]:
        if pieces[0].dtype != tf.float32:
            raise ValueError(f"PowerSGD aggregates float32 pieces, got {pieces[0].dtype.name}")
        n, me, cross, ranks = self._tiers()
        sizes = [int(p.shape[0]) for p in pieces]
        plan = self._plan(sizes, shapes, n)
        counter = self._memory.counter(name)
        stored = max(plan.share_length(o) for o in range(n))
        with tf.name_scope("node_sum"):
            share = self._node_sum(pieces, plan, n, me, name)
        with tf.name_scope("error_feedback"):
            residual = self._memory.read(name, stored, tf.float32, residual_scale)
            acc = share + (residual[:int(share.shape[0])] if stored != int(share.shape[0]) else residual)
        q_all = self._q.read(name, plan.q_length, tf.float32) if plan.q_length else None

        def step(exact: bool):
            def run():
                payload, new_residual = self._share_factors(acc, plan, me, q_all, cross, ranks, name, exact)
                with tf.name_scope("gather"):
                    gathered = (node_allgather(payload, self.topology, f"hvdx.powersgd.ag{'x' if exact else ''}.{name}")
                                if n > 1 else payload)
                outputs, q_new = self._rebuild(gathered, plan, n, exact)
                return outputs, new_residual, q_all if exact else q_new, tf.reduce_all(tf.math.is_finite(gathered))
            return run

        if self.start_step and any(it.rows for it in plan.items):
            outputs, new_residual, q_new, finite = tf.cond(counter < self.start_step, step(True), step(False),
                                                           name="start_step")
        else:
            outputs, new_residual, q_new, finite = step(False)()
        if stored != int(new_residual.shape[0]):
            new_residual = tf.pad(new_residual, [[0, stored - int(new_residual.shape[0])]])
        updates = self._memory.updates(name, new_residual, residual_scale) + [(counter, counter + 1)]
        if plan.q_length:
            updates += self._q.updates(name, q_new)
        return list(outputs), Aggregated(None, updates, finite=finite)

    def _node_sum(self, pieces: List[tf.Tensor], plan: _Plan, n: int, me: int, name: str) -> tf.Tensor:
        """This rank's share (its items end to end), summed over the node's ranks: one
        all-to-all over the node-local set (its share is the sum of what each rank sends)."""
        if n == 1:
            return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)
        order = [i for share in plan.shares for i in share]
        buffer = tf.concat([pieces[i] for i in order], axis=0)
        splits = [plan.share_length(o) for o in range(n)]
        received, _ = hvd.alltoall(buffer, splits=splits, process_set=self.topology.local_set,
                                   name=f"hvdx.powersgd.a2a.{name}")
        return tf.reduce_sum(tf.reshape(received, [n, splits[me]]), axis=0)

    def _share_factors(self, acc: tf.Tensor, plan: _Plan, me: int, q_all: Optional[tf.Tensor], cross: Any,
                       ranks: int, name: str, exact: bool) -> Tuple[tf.Tensor, tf.Tensor]:
        """Algorithms 1 and 2 on this rank's share `acc` across `cross`: (the factors to
        gather: P^ and the averaged Q of each matrix, the exact averages; the new residual).
        `exact`: every item averaged exactly (the steps before `start_step`)."""
        r = self.rank
        items = [plan.items[i] for i in plan.shares[me]]
        if not items:  # a share of nothing (fewer gradients than local ranks): the cross set's ranks all skip;
            return acc, acc  # acc (no elements) keeps the node all-to-all in a tf.function's graph (not pruned)
        parts, at = [], 0
        for it in items:
            parts.append((it, acc[at:at + it.size]))
            at += it.size
        matrices = [] if exact else [(it, tf.reshape(x, [it.rows, it.cols])) for it, x in parts if it.rows]
        qs = {}
        for it, _ in matrices:
            q = tf.reshape(q_all[it.q_offset:it.q_offset + it.cols * r], [it.cols, r])
            seed = tf.constant([zlib.crc32(name.encode()), it.index], tf.int64)
            # Q starts from a seeded draw, and again where it is all zero (a gradient that was zero)
            qs[it.index] = tf.cond(tf.reduce_any(tf.not_equal(q, 0.0)), lambda q=q: q,
                                   lambda it=it, seed=seed: tf.random.stateless_normal([it.cols, r], seed))
        sent = [tf.reshape(tf.matmul(m, qs[it.index]), [-1]) for it, m in matrices]
        sent += [x for it, x in parts if exact or not it.rows]
        summed = hvd.allreduce(tf.concat(sent, axis=0), op=hvd.Sum, process_set=cross, name=f"hvdx.powersgd.p.{name}")
        at = 0
        p_hats, q_locals = {}, []
        for it, m in matrices:
            p = tf.reshape(summed[at:at + it.rows * r], [it.rows, r])
            at += it.rows * r
            p_hats[it.index] = tf.linalg.qr(p)[0]
            q_locals.append(tf.matmul(m, p_hats[it.index], transpose_a=True))
        averages = summed[at:] / float(ranks)
        q_sums = []
        if matrices:
            q_sum = hvd.allreduce(tf.concat([tf.reshape(q, [-1]) for q in q_locals], axis=0), op=hvd.Sum,
                                  process_set=cross, name=f"hvdx.powersgd.q.{name}")
            q_sums = tf.split(q_sum / float(ranks), [it.cols * r for it, _ in matrices])
        payload, residual, exact_at = [], [], 0
        by_index = {it.index: (m, q_local, q_avg) for (it, m), q_local, q_avg in zip(matrices, q_locals, q_sums)}
        for it, x in parts:
            if it.index in by_index:
                m, q_local, q_avg = by_index[it.index]
                payload += [tf.reshape(p_hats[it.index], [-1]), q_avg]
                residual.append(tf.reshape(m - tf.matmul(p_hats[it.index], q_local, transpose_b=True), [-1]))
            else:
                payload.append(averages[exact_at:exact_at + it.size])
                exact_at += it.size
                residual.append(tf.zeros([it.size]))
        return tf.concat(payload, axis=0), tf.concat(residual, axis=0)

    def _rebuild(self, gathered: tf.Tensor, plan: _Plan, n: int, exact: bool) -> Tuple[List[tf.Tensor], tf.Tensor]:
        """Every piece's average from every local rank's factors (P^ Q^T for a matrix; all
        exact averages where `exact`), in the bucket's order, and the bucket's new Q vector."""
        r = self.rank
        outputs: List[Optional[tf.Tensor]] = [None] * len(plan.items)
        q_parts = {}
        at = 0
        for o in range(n):
            for i in plan.shares[o]:
                it = plan.items[i]
                if it.rows and not exact:
                    p_hat = tf.reshape(gathered[at:at + it.rows * r], [it.rows, r])
                    at += it.rows * r
                    q = gathered[at:at + it.cols * r]
                    at += it.cols * r
                    outputs[i] = tf.reshape(tf.matmul(p_hat, tf.reshape(q, [it.cols, r]), transpose_b=True), [-1])
                    q_parts[it.q_offset] = q
                else:
                    outputs[i] = gathered[at:at + it.size]
                    at += it.size
        q_new = tf.concat([q_parts[k] for k in sorted(q_parts)], axis=0) if q_parts else tf.zeros([0])
        return outputs, q_new

    def __repr__(self) -> str:
        options = [f"rank={self.rank}", *self._changed_options()]
        if self.process_set is not hvd.global_process_set:
            options.append(f"process_set={self.process_set.process_set_id}")
        return f"PowerSGD({', '.join(options)})"
