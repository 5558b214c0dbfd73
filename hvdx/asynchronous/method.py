"""What every shared-memory asynchronous method does around one node's shared model: start
(create or attach the segment, one model for all), read it into the variables, add this
process's update to it, record the update's staleness, average the nodes' models, finish.

The methods (`AsyncMiniBatch` in minibatch.py; `ASSM`, `PASSM`, `PASSMPlus` in passm.py)
differ only in which variables a process differentiates and updates, and in how it reads and
writes the shared vector (`read_mode`, `update_mode`, `read_back`).

One step on a process (gimpel2010 Algorithm 1; kungurtsev2021 Algorithm 1 for one core):

    the variables hold the shared model x as last read (version tau)
    g = gradient of the loss on this process's mini-batch, w.r.t. its own variables
    the (local, plain Keras) optimizer turns g into the step -alpha u, u = m u + g its momentum
    x += -alpha u on the shared vector (HvdxSharedUpdate); staleness = version before it - tau
    the variables read x again (HvdxSharedRead, or the update's read-back under the lock)

Across nodes there is one shared model per node; each node's first process averages its
node's model with the other nodes' every `average_every` of its steps (one Horovod allreduce
over hvdx's cross set of local rank 0), adding (average - what it read) to its node's
model so that the node's concurrent updates are kept.

Every method is an `hvdx.lifecycle.TrainingMethod`: in `Model.fit`,
`hvdx.callbacks.TrainingMethodCallback(method)` (or its old name `SharedModelCallback`) runs
the method's own `train_step` in place of Keras' for the duration of `fit`.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvdx import ops
from hvdx.arguments import integer, real
from hvdx.asynchronous.partition import Unit, layer_units, partition
from hvdx.asynchronous.shared import SharedModel, SharedModelError
from hvdx.asynchronous.staleness import Staleness, merge
from hvdx.lifecycle import TrainingMethod
from hvdx.topology import Topology, barrier, initialized, topology as current_topology
from hvdx.legacy_keras import keras_of
from hvdx.variables import broadcast_variables, slot_variables

__all__ = ["SharedModelMethod"]

_NAME_BYTES = 64


def _horovod():
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is None or not hvd.is_initialized() or not initialized():
        raise RuntimeError("the shared-model methods need hvdx.init() first (not only hvd.init()): they share one "
                           "model per node and average the nodes' models over hvdx's node-local and cross sets")
    return hvd


class SharedModelMethod(TrainingMethod):
    """The common machinery (module docstring). Subclasses set the class attributes and may
    override `full_step` and `modes` (what a process updates, and how, in the current phase).

    Args:
      average_every: steps of the node's first process between two averagings of the nodes'
        models (jobs of one node never average).
      staleness_bins: histogram bins of `Staleness`.
      timeout: seconds the node's processes may take to attach the segment.
      name: prefix of the Horovod collectives' names.

    Use: `start(model, optimizer)` (collective over all ranks), then per step either
    `apply_gradients(grads)` after `tape.gradient(loss, method.variables_to_train())` in a
    custom loop, or `TrainingMethodCallback(method)` (`SharedModelCallback(method)`) in
    `Model.fit`; `finish()` (collective).

    The lifecycle (`hvdx.lifecycle.TrainingMethod`): `start`; `begin_epoch` is `set_epoch`;
    `train_step(model, data)` replaces Keras' in `fit`; `after_step` counts and averages the
    nodes' models; `end_epoch` and `before_evaluation` `pull()` the node's model; `finish`;
    `close`; `state()` / `restore()` (epoch, steps, averagings); `reset(topology)`; `stats`.
    Every rank runs the same steps (the averaging counts them).
    """

    label = "a shared-model method"
    same_steps_on_every_rank = True
    needs_every_step = True
    replaces_train_step = True
    plain_optimizer_example = "tf.keras.optimizers.SGD(0.05, momentum=0.9)"
    read_mode = "none"
    update_mode = "atomic"
    read_back = False
    partitioned = False

    def __init__(self, *, average_every: int = 50, staleness_bins: int = 256, timeout: float = 120.0,
                 name: str = "hvdx.asynchronous") -> None:
        average_every = integer(average_every, "average_every", 1, expected="a positive number of steps (an int)")
        staleness_bins = integer(staleness_bins, "staleness_bins", 2)
        timeout = real(timeout, "timeout", 0, low_open=True, expected="a positive number of seconds")
        self.average_every, self.staleness_bins, self.timeout, self.name = average_every, staleness_bins, timeout, name
        self.shared: Optional[SharedModel] = None
        self.variables: List[tf.Variable] = []
        self.units: List[Unit] = []
        self.groups: List[Tuple[int, int]] = []
        self.staleness: Optional[Staleness] = None
        self.optimizer: Any = None
        self.steps = 0
        self.averagings = 0
        self.epoch = 0
        self._resume = False  # the next start() goes on counting (restore, reset)
        self._functions: Dict[Any, Any] = {}

    # -- phases (PASSM+ overrides) ---------------------------------------------------------
    def full_step(self) -> bool:
        """Whether this process differentiates and updates every variable in the current phase
        (ASSM, AsyncMiniBatch: always) or only its own group (PASSM)."""
        return not self.partitioned

    def set_epoch(self, epoch: int) -> bool:
        """Tells the method the epoch about to start; True when its phase changed (the
        step function must be rebuilt). Entering a phase that updates every variable after
        one that updated only this process's group (PASSM+ back to ASSM), the optimizer's
        state of the other variables (momentum u^c of Algorithm 1, Adam's moments) is zeroed:
        it is epochs old and was made at another learning rate, and it would be added to
        blocks that moved on without it."""
        before = self.full_step()
        started = self.optimizer is not None and bool(self.groups)
        own = {id(v) for v in self.variables_to_train()} if started and not before else None
        self.epoch = int(epoch)
        changed = before != self.full_step()
        if changed and own is not None:
            for v in self.variables:
                if id(v) not in own:
                    for slot in slot_variables(self.optimizer, v):
                        slot.assign(tf.zeros(slot.shape, slot.dtype))
        return changed

    def begin_epoch(self, epoch: int) -> bool:
        """The lifecycle's name of `set_epoch`."""
        return self.set_epoch(epoch)

    def modes(self) -> Tuple[str, str, bool]:
        """(read mode, update mode, read back) of the current phase."""
        return self.read_mode, self.update_mode, self.read_back

    # -- start / finish --------------------------------------------------------------------
    def start(self, model_or_variables, optimizer: Any = None, *, steps_per_epoch: Optional[int] = None,
              epochs: Optional[int] = None) -> "SharedModelMethod":
        """Collective over all ranks: every rank starts from rank 0's model; the node's first
        rank creates the node's shared model, the others attach; the name is removed once all
        attached (hvdx/asynchronous/shared.py). The counts (steps, averagings, staleness)
        start anew, or go on after `restore()` / `reset()`. `steps_per_epoch`, `epochs`: the
        lifecycle's, unused. Returns self.

        Raises ValueError (a synchronous optimizer, no or non-float32 variables, PASSM with
        fewer layers than processes per node), RuntimeError without hvdx.init()."""
        if optimizer is not None:
            self.check_optimizer(optimizer)
        hvd = _horovod()
        topo = current_topology()
        self.topology = topo
        self.variables, self.units = layer_units(model_or_variables)
        self.groups = partition(self.units, topo.local_size) if self.partitioned else [(0, len(self.units))]
        self.optimizer = optimizer
        if optimizer is not None and hasattr(optimizer, "build"):
            optimizer.build(self.variables)  # slots (momentum) for every variable: phases may change
        broadcast_variables(self.variables, root_rank=0)  # either Keras' (a Keras 3 variable's tf.Variable)
        flat = np.concatenate([np.ravel(v.numpy()) for v in self.variables]).astype(np.float32)
        sizes = [u.size for u in self.units]
        root = topo.local_ranks[0]
        shared, encoded, failure = None, np.zeros(_NAME_BYTES, np.uint8), None
        if topo.local_rank == 0:
            try:
                shared = SharedModel.create(sizes, flat)
                encoded = np.frombuffer(shared.name.encode().ljust(_NAME_BYTES, b"\0"), np.uint8)
            except Exception as exc:   # the others still get a (empty) name, and fail too
                failure = exc
        try:
            got = hvd.broadcast(tf.constant(encoded), root_rank=root, process_set=topo.local_set,
                                name=f"{self.name}.segment").numpy()
            name = bytes(got).rstrip(b"\0").decode()
            if failure is not None:
                raise failure
            if not name:
                raise SharedModelError(f"rank {root}, this node's first rank, could not create the node's shared "
                                       f"model (its error says why)")
            if shared is None:
                shared = SharedModel.attach(name, timeout=self.timeout)
            else:
                shared.wait_attached(topo.local_size, timeout=self.timeout)
        finally:
            if shared is not None:
                shared.unlink()   # creator: the name goes once all attached (or on any failure)
        self.shared = shared
        self._address = shared.address
        n = shared.size
        self._slices = []
        offset = 0
        for v in self.variables:
            size = int(np.prod(v.shape))
            self._slices.append((offset, offset + size))
            offset += size
        self._pulled = tf.Variable(tf.zeros([n], tf.float32), trainable=False, name="shared_pulled")
        self._version = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="shared_version")
        if not self._resume or self.staleness is None:
            self.staleness = Staleness(self.staleness_bins)
        if not self._resume:
            self.steps = 0
            self.averagings = 0
        self._resume = False
        self._functions = {}
        self.pull()
        return self

    def finish(self) -> None:
        """Collective over all ranks: waits for the node's processes, averages the nodes'
        models a last time, and every rank's variables take its node's final shared model
        (the same on every rank). Then unmaps the segment (idempotent)."""
        if self.shared is None:
            return
        hvd = _horovod()
        topo = self.topology
        barrier(topo.local_set)
        if topo.num_nodes > 1 and topo.local_rank == 0:
            self._average(hvd, final=True)
        barrier(topo.local_set)
        self.pull()
        shared, self.shared = self.shared, None
        self._functions = {}
        shared.close()

    def close(self) -> None:
        """Unmaps the segment without the final collectives (after an error); idempotent."""
        shared, self.shared = self.shared, None
        self._functions = {}
        if shared is not None:
            shared.close()

    def reset(self, topology: Optional[Topology] = None) -> None:
        """The membership changed (`topology`; default `hvdx.topology()` now). Without
        collectives: unmaps the node's segment (`close()`; its name is gone since every
        process attached, so the memory goes with the last process's unmap), keeps the
        counts (`state()`) and the variables (the model as this rank last read it), plans
        PASSM's groups for the new processes per node. The next start() makes a new segment
        per node from rank 0's model (collective)."""
        self.close()
        topo = topology if topology is not None else current_topology()
        self.topology = topo
        if self.units:
            self.groups = partition(self.units, topo.local_size) if self.partitioned else [(0, len(self.units))]
        self._resume = True

    def state(self) -> Dict[str, Any]:
        """{"epoch", "steps", "averagings"} of this rank (JSON)."""
        return {"epoch": self.epoch, "steps": self.steps, "averagings": self.averagings}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Takes back a `state()` (before `start()`, which then goes on counting from it)."""
        self.epoch, self.steps, self.averagings = int(state["epoch"]), int(state["steps"]), int(state["averagings"])
        self._resume = True

    # -- Model.fit ---------------------------------------------------------------------------
    def train_step(self, model: Any, data: Any) -> Any:
        """Keras' step in `fit` (traced): reads the node's shared model (the freshest x; a
        method whose update reads it back skips this), differentiates `variables_to_train()`
        only (PASSM: restricted backpropagation), applies the model's optimizer to them and
        adds the update to the shared model. Returns the metrics' logs."""
        x, y, sample_weight = keras_of(model).utils.unpack_x_y_sample_weight(data)
        self.step_begin_ops()
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x, y, y_pred, sample_weight)
            tracker = getattr(model, "_loss_tracker", None)  # Keras 3: its train_step feeds the loss metric
            if tracker is not None:
                batch = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
                tracker.update_state(loss, sample_weight=batch)
                loss = model.optimizer.scale_loss(loss)  # Keras 3's LossScaleOptimizer unscales in apply
        own = self.variables_to_train()
        grads = tape.gradient(loss, own)
        model.optimizer.apply_gradients(zip(grads, own))
        self.push_ops(read_after=False)
        return model.compute_metrics(x, y, y_pred, sample_weight)

    def end_epoch(self, epoch: int, logs: Optional[Mapping[str, Any]]) -> None:
        """The variables take the node's shared model (callbacks after the driver, e.g.
        checkpoints, and the validation see it)."""
        self.pull()

    def before_evaluation(self) -> None:
        """The variables take the node's shared model (fit's validation evaluates it)."""
        if self.shared is not None:
            self.pull()

    # -- one step ----------------------------------------------------------------------------
    def own_range(self) -> Tuple[int, int, int, int]:
        """(first variable, last variable, first element, last element) this process updates
        in the current phase."""
        if self.full_step():
            return 0, len(self.variables), 0, self.units[-1].end
        first, last = self.groups[self.topology.local_rank]
        return (self.units[first].first, self.units[last - 1].last, self.units[first].begin,
                self.units[last - 1].end)

    def variables_to_train(self) -> List[tf.Variable]:
        """The variables to differentiate and update this step: all of them, or this process's
        group (PASSM: restricted backpropagation is `tape.gradient(loss, these)`)."""
        first, last, _, _ = self.own_range()
        return self.variables[first:last]

    def pull_ops(self) -> None:
        """Graph-compatible: the variables take the shared model (read in `read_mode`)."""
        values, version = ops.shared_read(self._address, self.modes()[0])
        self._assign(values, version)

    def push_ops(self, read_after: bool = True) -> None:
        """Graph-compatible: adds (own variables - what they were read as) to the shared model
        in `update_mode`, records the staleness, then reads the model again: from the
        update's read-back when the mode has one (always), else with `read_after` (a step
        that starts with `pull_ops` passes False)."""
        read_mode, update_mode, read_back = self.modes()
        first, last, begin, end = self.own_range()
        local = tf.concat([tf.reshape(v, [-1]) for v in self.variables[first:last]], 0)
        delta = local - self._pulled[begin:end]
        before, back = ops.shared_update(self._address, delta, begin, update_mode, read_back)
        self.staleness.record(before - self._version)
        if read_back:
            self._assign(back, before + 1)
        elif read_after:
            values, version = ops.shared_read(self._address, read_mode)
            self._assign(values, version)

    def step_begin_ops(self) -> None:
        """Graph-compatible, at the start of a step: reads the shared model unless the last
        update read it back under its lock (gimpel2010: theta' <- theta inside the lock)."""
        if not self.modes()[2]:
            self.pull_ops()

    def _assign(self, values: tf.Tensor, version: tf.Tensor) -> None:
        self._pulled.assign(values)
        self._version.assign(version)
        for v, (lo, hi) in zip(self.variables, self._slices):
            v.assign(tf.reshape(values[lo:hi], v.shape))

    def _function(self, key: str, fn):
        phase = (key, self.full_step())
        if phase not in self._functions:
            self._functions[phase] = tf.function(fn, autograph=False)
        return self._functions[phase]

    def pull(self) -> None:
        """The variables take the node's shared model."""
        self._live()
        self.pull_ops()   # eager: a start, a finish, an evaluation

    def push(self) -> None:
        """After the optimizer updated `variables_to_train()`: the update joins the shared
        model, and the variables take the model anew."""
        self._live()
        self.push_ops()
        self.after_step()

    def apply_gradients(self, grads: Sequence[tf.Tensor]) -> None:
        """Custom loops: the optimizer applies `grads` (of `variables_to_train()`, in order) to
        the local variables, then `push()`."""
        self._live()
        if self.optimizer is None:
            raise RuntimeError("apply_gradients needs the optimizer: start(model, optimizer)")
        own = self.variables_to_train()
        grads = list(grads)
        if len(grads) != len(own):
            raise ValueError(f"got {len(grads)} gradients for {len(own)} variables: differentiate "
                             f"method.variables_to_train() (PASSM: this process's own layers only)")
        fn = self._function("apply", lambda g: (self.optimizer.apply_gradients(zip(g, own)), self.push_ops()))
        fn(grads)
        self.after_step()

    def after_step(self) -> None:
        """Counts the step; every `average_every` steps the node's first process averages the
        nodes' models (Python side: after the traced step)."""
        self.steps += 1
        topo = self.topology
        if topo.num_nodes > 1 and topo.local_rank == 0 and self.steps % self.average_every == 0:
            self._average(_horovod())

    def _average(self, hvd, final: bool = False) -> None:
        values, _ = ops.shared_read(self._address, "none")
        mean = hvd.allreduce(values, op=hvd.Average, process_set=self.topology.cross_set,
                             name=f"{self.name}.average")
        if final:
            # the node's processes wait at a barrier: the mean is written as it is, so that every
            # node ends with the same bits (x + (mean - x) may round differently on each node)
            self.shared.params[:] = mean.numpy()
        else:
            ops.shared_update(self._address, mean - values, 0, "atomic")
        self.averagings += 1

    def _live(self) -> None:
        if self.shared is None:
            raise RuntimeError(f"{type(self).__name__} is not started (or already finished): call "
                               f"start(model, optimizer) first (collective over all ranks)")

    # -- what happened ------------------------------------------------------------------
    def stats(self) -> Dict[str, Any]:
        """This process's record: steps, averagings, staleness summary, its group."""
        first, last, begin, end = self.own_range() if self.units else (0, 0, 0, 0)
        return {"method": self.label, "steps": self.steps, "averagings": self.averagings,
                "staleness": self.staleness.summary() if self.staleness is not None else None,
                "own_elements": [begin, end]}

    @staticmethod
    def merge_staleness(summaries: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        return merge(summaries)
