"""What the sparse strategies share: error feedback around MSTopK, and the exchange.

A sparse strategy adds its residual to this step's buffer, selects k = density * length
entries of large magnitude with MSTopK (shi2021 Alg. 1), sends their (value, index) pairs
in one all-gather (`hvdx.comm.wire`), and keeps everything it did not send, including
the wire's rounding, as its next residual (committed only on finite steps).

Deep Gradient Compression's convergence aids (`hvdx.comm.dgc`) are options of every sparse
strategy: `momentum` (momentum correction), `momentum_masking`, `clip_norm` (local
gradient clipping), `warmup_steps` / `warmup_density` (density warm-up) and
`residual_decay`. They are applied here, around the selection, so each strategy only
says how its pairs travel (`_sparse_aggregate`) and how it averages the warm-up's stages
whose pairs would cost more than the dense buffer (`dense_from`, `_dense_aggregate`). So is
`dense_below`: a bucket's gradients of fewer elements (biases, batch norm, small layers) are
sent whole every step, beside the top-k of the rest, in the same exchange.

Which aids a sparse strategy applies by default for an optimizer is decided here too
(`TopKStrategy.defaults_for`, from the optimizer's `hvdx.comm.traits.OptimizerTraits`),
by the rules measured with benchmarks/convergence.py (benchmarks/README.md).
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import ops
from hvdx.arguments import is_integer, is_real
from hvdx.comm import dgc, wire
from hvdx.comm.base import Aggregated, Strategy, check_density, check_positive_int
from hvdx.comm.memory import ResidualMemory, Update
from hvdx.comm.traits import OptimizerTraits
from hvdx.node.collectives import node_allgather
from hvdx.topology import Topology

__all__ = ["ADAM_WARMUP_DENSITY", "ADAM_WARMUP_STEPS", "AIDS", "AUTO_MOMENTUM_CORRECTION_DENSITY", "DENSE_BELOW",
           "LAMB_WARMUP_DENSITY", "LAMB_WARMUP_STEPS", "LARS_MOMENTUM_CORRECTION_DENSITY", "STEPS_AGREEMENT",
           "TopKStrategy"]

#: The collective name of the step counters' agreement (`TopKStrategy.agree_state`).
STEPS_AGREEMENT = "hvdx.sparse.steps.agree"

#: The density the sparse strategies use when none is given.
DEFAULT_DENSITY = 0.01

#: DGC's convergence aids (`hvdx.comm.dgc`), options of every sparse strategy, with the
#: values that leave them off.
AIDS = {"momentum": 0.0, "momentum_masking": True, "clip_norm": None, "warmup_steps": 0,
        "warmup_density": 0.25, "residual_decay": 1.0}

#: Momentum correction is on by default up to this density (its masking presumes a sparse
#: selection: at density 1 it would reset every velocity each step).
AUTO_MOMENTUM_CORRECTION_DENSITY = 0.1
#: For hvdx's LARS (with its local trust ratio) only up to this density: measured on the
#: small ResNet (benchmarks/README.md, convergence.py --optimizer lars), momentum correction
#: helps at density 0.01 (0.829 against 0.501 without, 3 seeds) and hurts above it (0.02:
#: 0.573 against 0.642, one seed; 0.05: 0.391 against 0.900, 3 seeds).
LARS_MOMENTUM_CORRECTION_DENSITY = 0.01
#: A bucket's gradients with fewer elements than this are sent whole every step, not
#: sparsified (`TopKStrategy(dense_below=)`; 0: every gradient competes in the top-k).
DENSE_BELOW = 1024
#: The density warm-up an Adam-family optimizer (adaptive, no trust ratio) gets by default:
#: 4 stages of 50 steps from dense (density 1), below that density (measured on Horovod's Keras
#: MNIST example at 75 and 300 steps: benchmarks/README.md, "horovod_examples.py: short runs").
#: Adam divides by the second moment of what it is given: a sparse exchange sends an entry
#: about every T = 1/density steps at about T times its size, so the moment grows ~T-fold and
#: the steps shrink ~sqrt(T)-fold while the residuals fill (the trailing of short runs).
ADAM_WARMUP_STEPS = 200
ADAM_WARMUP_DENSITY = 1.0
#: LAMB's (adaptive with a trust ratio): 4 stages of 25 steps from 25 % (a dense start did worse
#: on the small ResNet: benchmarks/README.md, convergence.py --optimizer lamb).
LAMB_WARMUP_STEPS = 100
LAMB_WARMUP_DENSITY = 0.25


class Selection(NamedTuple):
    """`TopKStrategy._select`'s result: the k (value, index) pairs (values as selected,
    before any rounding), k, the residual updates, and where `value_bits` is set the pairs'
    quantized packet (`wire.pack_quantized`), else None."""
    values: tf.Tensor
    indices: tf.Tensor
    k: int
    updates: List[Update]
    packet: Optional[tf.Tensor]


class TopKStrategy(Strategy):
    """Base of NaiveAG and HiTopK: error feedback + MSTopK + (value, index) all-gather."""

    lossy = True
    options = ("density", "num_samplings", "wire_dtype", "value_bits", "dense_below", *AIDS)
    quiet_defaults = {**AIDS, "dense_below": DENSE_BELOW, "value_bits": None}

    def __init__(self, density: float = DEFAULT_DENSITY, num_samplings: int = 30,
                 wire_dtype: tf.DType = tf.float32, topo: Optional[Topology] = None,
                 index_dtype: Optional[tf.DType] = None, *, value_bits: Optional[int] = None,
                 dense_below: int = DENSE_BELOW, momentum: float = 0.0,
                 momentum_masking: bool = True, clip_norm: Optional[float] = None, warmup_steps: int = 0,
                 warmup_density: float = 0.25, residual_decay: float = 1.0) -> None:
        """Args: density, num_samplings (MSTopK), wire_dtype, value_bits (None: values travel
        in wire_dtype; 8 or 4: as integer codes with a float32 scale per chunk of at most
        `wire.VALUE_CHUNK` values, `wire.pack_quantized`, across the strategy's slow exchange;
        the codes' rounding stays in the residual, as the float16 wire's does), dense_below (a bucket's
        gradients of fewer elements are sent whole every step: their residual stays zero
        and, with momentum correction, their velocity is kept, i.e. momentum SGD; 0: off;
        only where the strategy is given the bucket's pieces, `aggregate_pieces`), and DGC's
        aids (`hvdx.comm.dgc`): momentum (momentum correction; 0: off), momentum_masking,
        clip_norm (local clipping; None: off), warmup_steps (density warm-up; 0: off) from
        warmup_density, residual_decay (1: plain error feedback). ValueError on a bad value."""
        super().__init__(topo)
        #: MSTopK's index type: None picks int32 below 2**31 elements (the aggregator's
        #: buckets always are), int64 above; tf.int64 forces the wide path end to end.
        self.index_dtype = index_dtype
        self.density = check_density(density)
        self.num_samplings = check_positive_int(num_samplings, "num_samplings")
        if not is_integer(dense_below) or dense_below < 0:
            raise ValueError(f"dense_below must be an int >= 0 (elements; 0: every gradient sparsified), got "
                             f"{dense_below!r}")
        self.dense_below = int(dense_below)
        self._whole: List[Tuple[int, int]] = []  # the pieces sent whole while a bucket's call is built
        self.wire_dtype = wire.check_dtype(wire_dtype)
        self.value_bits = wire.check_bits(value_bits, optional=True)
        if self.value_bits is not None and self.wire_dtype != tf.float32:
            raise ValueError(f"value_bits={self.value_bits} and wire_dtype={self.wire_dtype.name} both say how the "
                             f"values travel: give one of them")
        dgc.check_aids(momentum, momentum_masking, clip_norm, warmup_steps, warmup_density, residual_decay,
                       self.density)
        self.momentum = float(momentum)
        self.momentum_masking = momentum_masking
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.warmup_steps = int(warmup_steps)
        self.warmup_density = float(warmup_density)
        self.residual_decay = float(residual_decay)
        self._density_now: Optional[float] = None  # the warm-up stage's density while its branch is built
        self._memory = ResidualMemory(self.key)
        #: DGC's velocities (momentum correction), kept like residuals: per rank, per buffer.
        self._velocities = ResidualMemory(f"{self.key}_velocity")
        self.last_indices: Optional[tf.Tensor] = None  # diagnostics: last call's selection

    @property
    def corrects_momentum(self) -> bool:
        """DGC's momentum correction is on (a momentum given or decided by `defaults_for`)."""
        return bool(self.momentum)

    @classmethod
    def defaults_for(cls, traits: OptimizerTraits, options: Mapping[str, Any]) -> Dict[str, Any]:
        """The aids applied by default for an optimizer of `traits`, at the density of
        `options` (what the user gave; DEFAULT_DENSITY if none), each only where `options`
        does not set it (benchmarks/README.md, convergence.py measured them):

        - local_trust_ratio (applied by hvdx's optimizer wrapper): True for a trust ratio that
          measures the gradient (LARS with classic momentum) at density <=
          AUTO_MOMENTUM_CORRECTION_DENSITY;
        - momentum (DGC's momentum correction; not where the wrapper was given
          momentum_correction): the optimizer's momentum, in (0, 1) and not Nesterov's, for an
          optimizer without a trust ratio at density <= AUTO_MOMENTUM_CORRECTION_DENSITY, or
          with the local trust ratio on (without it momentum correction is LARS' worst case:
          the trust ratio would normalise the accumulated velocity) at density <=
          LARS_MOMENTUM_CORRECTION_DENSITY;
        - warmup_steps, warmup_density: for an adaptive optimizer below the warm-up's start
          density (warmup_density where given): ADAM_WARMUP_STEPS from ADAM_WARMUP_DENSITY
          (dense) for the Adam family, LAMB_WARMUP_STEPS from LAMB_WARMUP_DENSITY for an
          adaptive optimizer with a trust ratio (LAMB).
        """
        density = options.get("density", DEFAULT_DENSITY)
        if not is_real(density):
            return {}  # the constructor rejects it
        density = float(density)
        out: Dict[str, Any] = {}
        trust = options.get("local_trust_ratio")
        if trust is None:
            trust = traits.trust_ratio == "gradient" and density <= AUTO_MOMENTUM_CORRECTION_DENSITY
            if trust:
                out["local_trust_ratio"] = True
        if "momentum" not in options and options.get("momentum_correction") is None:
            trusted = bool(trust) and traits.trust_ratio == "gradient"
            limit = LARS_MOMENTUM_CORRECTION_DENSITY if trusted else AUTO_MOMENTUM_CORRECTION_DENSITY
            if (traits.trust_ratio is None or trusted) and traits.momentum is not None \
                    and 0 < traits.momentum < 1 and not traits.nesterov and density <= limit:
                out["momentum"] = float(traits.momentum)
        if "warmup_steps" not in options and traits.adaptive:
            steps, start = ((ADAM_WARMUP_STEPS, ADAM_WARMUP_DENSITY) if traits.trust_ratio is None
                            else (LAMB_WARMUP_STEPS, LAMB_WARMUP_DENSITY))
            given_start = options.get("warmup_density")
            if given_start is None or not is_real(given_start):
                if density < start:
                    out.update(warmup_steps=steps, warmup_density=start)
            elif density < float(given_start):
                out["warmup_steps"] = steps
        return out

    @property
    def memory(self) -> ResidualMemory:
        return self._memory

    @property
    def memories(self) -> List[ResidualMemory]:
        """The residuals' memory, and the velocities' where momentum correction is on."""
        return [self._memory, self._velocities] if self.momentum else [self._memory]

    @property
    def velocities(self) -> Dict[str, tf.Variable]:
        """DGC's velocities by buffer name (momentum correction; empty without)."""
        return self._velocities.variables_by_name

    def residual_length(self, d: int) -> int:
        """The length of the residual kept for a d-element buffer: the same on every rank,
        so that a checkpoint restores anywhere (a residual written by another rank then
        reads as zeros, `ResidualMemory.read`)."""
        return d

    @property
    def warmup(self) -> Optional[dgc.DensityWarmup]:
        """The density warm-up schedule, or None when `warmup_steps` is 0."""
        if not self.warmup_steps:
            return None
        return dgc.DensityWarmup(self.warmup_density, self.density, self.warmup_steps)

    def create_state(self, name: str, d: int, shapes=None) -> None:
        self._memory.variable(name, self.residual_length(d), tf.float32)
        if self.momentum:
            self._velocities.variable(name, self.residual_length(d), tf.float32)
        self._memory.counter(name)  # the density warm-up's stage and MSTopK's seed

    def agree_state(self, names: Sequence[str], process_set: hvd.ProcessSet) -> None:
        """Sets the step counter of each buffer of `names` to its largest value over the ranks
        of `process_set` (one eager all-reduce): the counter picks the density warm-up's stage,
        i.e. the shapes of the exchange, so ranks must hold the same one. They differ after an
        elastic reset that adds processes (a returning node's are at step 0, or 1 after
        Horovod's one-step fit, the survivors further on) until the state's sync, which comes
        after the first step in Horovod's own pattern."""
        self._memory.agree_counters(names, process_set, STEPS_AGREEMENT)

    def k(self, length: int) -> int:
        """How many entries of a `length`-element buffer are sent: max(1, round(density * length)),
        the density being the warm-up stage's while a stage is built."""
        density = self._density_now if self._density_now is not None else self.density
        return max(1, int(round(density * length)))

    def whole_indices(self, offset: int, length: int) -> List[int]:
        """The entries of elements [offset, offset + length) of the bucket being aggregated
        that belong to pieces sent whole (`dense_below`), relative to `offset`."""
        out: List[int] = []
        for start, stop in self._whole:
            lo, hi = max(start, offset), min(stop, offset + length)
            out.extend(range(lo - offset, hi - offset))
        return out

    def k_sent(self, offset: int, length: int) -> int:
        """Pairs sent for elements [offset, offset + length): the top-k's `k(length)` plus the
        entries sent whole there."""
        return self.k(length) + len(self.whole_indices(offset, length))

    def _aggregate_pieces(self, pieces: List[tf.Tensor], name: str, residual_scale: Optional[tf.Tensor] = None,
                          grouped: bool = False, shapes=None) -> Tuple[List[tf.Tensor], Aggregated]:
        """As `Strategy._aggregate_pieces`, the pieces of fewer than `dense_below` elements
        marked to be sent whole (unless every piece is: the bucket then goes sparse as one)."""
        whole, start = [], 0
        for piece in pieces:
            stop = start + int(piece.shape[0])
            if stop - start < self.dense_below:
                whole.append((start, stop))
            start = stop
        self._whole = whole if len(whole) < len(pieces) else []
        try:
            return super()._aggregate_pieces(pieces, name, residual_scale, grouped)
        finally:
            self._whole = []

    def _aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None) -> Aggregated:
        """Local clipping of this rank's buffer, then the strategy's `_sparse_aggregate`, at the
        density of the warm-up's stage (one branch per stage, chosen by the buffer's step
        counter, identical on every rank); a warm-up stage at `dense_from` or above is
        `_dense_aggregate`'s instead (the target density's always sparse)."""
        if self.clip_norm is not None:
            with tf.name_scope("local_clip"):
                buffer = dgc.local_clip(buffer, self.clip_norm, self.topology.size, residual_scale)
        counter = self._memory.counter(name)
        warmup = self.warmup
        if warmup is None:
            result = self._sparse_aggregate(buffer, name, residual_scale)
            return dataclasses.replace(result, updates=result.updates + [(counter, counter + 1)])
        densities = warmup.densities()
        dense = [density >= self.dense_from() for density in densities[:-1]] + [False]
        built = []

        def branch(stage: int):
            def build():
                self._density_now = densities[stage]
                try:
                    aggregate = self._dense_aggregate if dense[stage] else self._sparse_aggregate
                    result = aggregate(buffer, name, residual_scale)
                finally:
                    self._density_now = None
                built.append(result)
                local = result.local_slice[0] if result.local_slice is not None else tf.zeros([0])
                return result.output, result.finite, local, [value for _, value in result.updates]
            return build

        if tf.executing_eagerly():
            output, finite, local, values = branch(warmup.stage(int(counter.numpy())))()
        else:
            branches = [branch(stage) for stage in range(len(densities))]
            output, finite, local, values = tf.switch_case(warmup.stage(counter), branches, name="density_warmup")
        first = built[0]
        updates = [(variable, value) for (variable, _), value in zip(first.updates, values)]
        updates.append((counter, counter + 1))
        local_slice = None if first.local_slice is None else (local, first.local_slice[1])
        return Aggregated(output, updates, local_slice=local_slice, finite=finite)

    def _sparse_aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None
                          ) -> Aggregated:
        """The strategy's work at density `k()`: selection (`_select`) and exchange."""
        raise NotImplementedError

    def _select(self, grads: List[tf.Tensor], name: str, residual_scale: Optional[tf.Tensor],
                stored: Optional[int] = None, offset: int = 0) -> Selection:
        """Error feedback around MSTopK: the `Selection` for acc = sum(grads) + residual; the
        new residual is acc with the sent values taken out (with `value_bits`, their codes'
        decoded values: the packet that is sent is the one made here, quantized once).
        The pairs are MSTopK's k(length) of the entries not sent whole, then every entry sent
        whole (`whole_indices`; k counts both). `stored`: the residual's length where it
        exceeds the grads' (its tail stays zero); `offset`: where the grads sit in the bucket."""
        length = int(grads[0].shape[0])
        stored = length if stored is None else stored
        acc, velocity = self._accumulate(grads, name, residual_scale, stored)
        k = self.k(length)
        whole = self.whole_indices(offset, length)
        candidates = acc
        if whole:  # the entries sent whole do not compete in the top-k (nor are sent twice): zeroed in
            at = tf.constant(whole, tf.int64)  # place (acc's buffer, nothing else reads it after the gather)
            whole_values = tf.gather(acc, at)
            candidates = ops.sparse_accumulate(-whole_values, at, length, out=acc)
        # The window's offset: a function of (buffer, step), both checkpointed, so that a resumed
        # run selects what the uninterrupted one would have.
        seed = tf.stack([tf.constant(zlib.crc32(name.encode()), tf.int64), self._memory.counter(name)])
        values, indices = ops.stateless_mstopk(candidates, k, seed, num_samplings=self.num_samplings,
                                               index_dtype=self.index_dtype)
        selected = indices
        if whole:
            values = tf.concat([values, whole_values], axis=0)
            indices = tf.concat([indices, tf.constant(whole, indices.dtype)], axis=0)
            k += len(whole)
        packet = None
        if self.value_bits is None:
            sent = wire.decode_sent(values, self.wire_dtype)
        else:
            packet, sent = wire.pack_quantized(values, indices, self.value_bits)
        # What was not sent stays: unselected entries whole, and the wire's rounding at the
        # selected ones (at the entries sent whole, which candidates holds as zeros: their
        # value less what was sent). sparse_accumulate updates candidates in place (nothing
        # else reads it now).
        with tf.name_scope("error_feedback"):
            taken = -sent
            if whole:
                taken = tf.concat([taken[:k - len(whole)], whole_values - sent[k - len(whole):]], axis=0)
            new_residual = ops.sparse_accumulate(taken, indices, length, out=candidates)
            if velocity is not None and self.momentum_masking:  # not the entries sent whole: their momentum
                velocity = dgc.mask_velocity(velocity, selected, whole)  # runs on, also where MSTopK filled up with their zeros
            updates = self._state_updates(name, new_residual, velocity, stored, residual_scale)
        self.last_indices = indices
        return Selection(values, indices, k, updates, packet)

    def _accumulate(self, grads: List[tf.Tensor], name: str, residual_scale: Optional[tf.Tensor], stored: int
                    ) -> Tuple[tf.Tensor, Optional[tf.Tensor]]:
        """Error feedback's accumulation (with DGC's momentum correction): (acc, velocity) =
        `dgc.accumulate` of `grads` with this rank's residual (and velocity) of buffer `name`,
        both read at their `stored` length and cut to the grads'. ValueError: not float32."""
        length = int(grads[0].shape[0])
        if grads[0].dtype != tf.float32:
            raise ValueError(f"{type(self).__name__} aggregates float32 buffers, got {grads[0].dtype.name}")
        with tf.name_scope("error_feedback"):
            residual = self._memory.read(name, stored, tf.float32, residual_scale)
            residual = residual if stored == length else residual[:length]
            velocity = None
            if self.momentum:  # DGC: momentum correction
                velocity = self._velocities.read(name, stored, tf.float32, residual_scale)
                velocity = velocity if stored == length else velocity[:length]
            return dgc.accumulate(grads, residual, velocity, self.momentum, self.residual_decay)

    def _state_updates(self, name: str, residual: tf.Tensor, velocity: Optional[tf.Tensor], stored: int,
                       residual_scale: Optional[tf.Tensor]) -> List[Update]:
        """The writes of buffer `name`'s new residual (and velocity), zero-padded to `stored`:
        the same variables, in the same order, whichever path made them."""
        pad = stored - int(residual.shape[0])
        updates = self._memory.updates(name, tf.pad(residual, [[0, pad]]) if pad else residual, residual_scale)
        if velocity is not None:
            updates += self._velocities.updates(name, tf.pad(velocity, [[0, pad]]) if pad else velocity,
                                                residual_scale)
        return updates

    def dense_from(self) -> float:
        """The lowest warm-up density whose stage is averaged dense (`_dense_aggregate`), not
        sparse: where the pairs, all-gathered over the M members of the strategy's slow
        exchange (`gather_members`), carry at least the bytes of a ring all-reduce of the same
        entries in float32: rho (b_v + b_i) (M - 1) >= 2 (M - 1) / M * 4, i.e.
        rho >= 8 / (M (b_v + b_i)), with M at least 2 (b_v, b_i: a pair's value and index
        bytes on the wire). 0.5 for float32 pairs between two members."""
        value = self.value_bits / 8 if self.value_bits is not None else self.wire_dtype.size
        index = (self.index_dtype or tf.int32).size
        return min(1.0, 8.0 / (max(2, self.gather_members()) * (value + index)))

    def gather_members(self) -> int:
        """How many members all-gather the pairs over the slow links (every rank here)."""
        return self.topology.size

    def _dense_aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None
                         ) -> Aggregated:
        """A warm-up stage at `dense_from` or above: every entry of acc = buffer + residual
        (error feedback, momentum correction) averaged by one float32 all-reduce of every
        rank. As top-k of all entries would: the residual becomes zero, and with masking the
        velocity too (but at the entries sent whole, `dense_below`, whose momentum runs on)."""
        d = int(buffer.shape[0])
        acc, velocity = self._accumulate([buffer], name, residual_scale, self.residual_length(d))
        total = hvd.allreduce(acc, op=hvd.Sum, process_set=hvd.global_process_set, name=f"hvdx.{self.key}.dense.{name}")
        output = total / tf.cast(self.topology.size, total.dtype)
        updates = self._dense_updates(name, acc, velocity, 0, self.residual_length(d), residual_scale)
        return Aggregated(output, updates, finite=self._finite(output))

    def _dense_updates(self, name: str, acc: tf.Tensor, velocity: Optional[tf.Tensor], offset: int, stored: int,
                       residual_scale: Optional[tf.Tensor]) -> List[Update]:
        """`_dense_aggregate`'s state writes (residual and velocity of `stored` elements) for an
        accumulated `acc` of elements [offset, offset + len(acc)) of the bucket, every one sent."""
        length = int(acc.shape[0])
        if velocity is not None and self.momentum_masking:
            whole = self.whole_indices(offset, length)
            if whole:
                at = tf.constant(whole, tf.int64)[:, None]
                velocity = tf.scatter_nd(at, tf.gather_nd(velocity, at), [length])
            else:
                velocity = tf.zeros_like(velocity)
        with tf.name_scope("error_feedback"):
            return self._state_updates(name, tf.zeros_like(acc), velocity, stored, residual_scale)

    def _exchange(self, values: tf.Tensor, indices: tf.Tensor, k: Union[int, Sequence[int]],
                  process_set: hvd.ProcessSet, name: str, node_engine: str = "horovod",
                  packet: Optional[tf.Tensor] = None) -> Tuple[tf.Tensor, tf.Tensor]:
        """All-gather of every member's pairs: k per member, or one k per member in order.
        node_engine "shm": `process_set` is the node's, gathered through its shared-memory
        segment (`hvdx.node.collectives.node_allgather`). packet: the pairs as `_select` packed
        them with `value_bits` (sent as they are); None: `values` and `indices` go in wire_dtype.
        Returns (float32 values, indices) of every member, members in order."""
        bits = None if packet is None else self.value_bits
        packed = wire.pack(values, indices, self.wire_dtype) if packet is None else packet
        if node_engine == "shm":
            topo = self.topology
            if process_set is not topo.local_set:
                raise ValueError("node_engine='shm' gathers inside the node only (topo.local_set)")
            gathered = node_allgather(packed, topo, name, node_engine)
        else:
            gathered = hvd.allgather(packed, process_set=process_set, name=name)
        if bits is None:
            return wire.unpack(gathered, k, indices.dtype)
        return wire.unpack_quantized(gathered, k, indices.dtype, bits, senders=process_set.size())

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
        changed = "".join(f", {option}" for option in self._changed_options())
        return (f"{type(self).__name__}(density={self.density}, num_samplings={self.num_samplings}, "
                f"wire_dtype={self.wire_dtype.name}{changed})")

