"""DASO the training method (coquelin2021): what hvdx's two DASO optimizers share, whatever
the Keras. `DASOMethod` is mixed into an hvdx optimizer wrapper that averages gradients over a
process set: `hvdx.daso.optimizer.DASO` (Keras 2, tf_keras) and
`hvdx.daso.keras3_optimizer.DASO` (Keras 3); `hvdx.DASO(optimizer, ...)` makes the one of the
optimizer's Keras.

What is here: the arguments and the schedule (`hvdx.daso.schedule`), the step's guard (the
variables of the first traced step, every rank on rank 0's parameters before it, no second
step without `after_step()`), the node-local aggregation (none in a node of one rank), the
global synchronisation between steps (`hvdx.daso.sync` over `hvdx.transport.ring`), the
lifecycle (`hvdx.lifecycle.TrainingMethod`), the schedule's state in checkpoints and configs,
and the elastic reset. What each Keras adapter adds: its wrapper's constructor, the step entry
point (`apply_gradients` on Keras 2, `apply` on Keras 3) calling `_guarded_step`, its Keras'
serialisation of the wrapped optimizer in `get_config` / `from_config`.
"""
from __future__ import annotations

import collections
import json
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdx.agreement import check_agreement
from hvdx.arguments import real
from hvdx.buckets import AggregationObserver, AggregationRecord
from hvdx.comm import wire
from hvdx.daso.schedule import Action, Schedule
from hvdx.daso.sync import FlatParameters, ParameterSync, SyncStats
from hvdx.lifecycle import TrainingMethod, find_method
from hvdx.plateau import PlateauDetector
from hvdx.topology import Topology, elastic_job, initialized as _initialized, topology as _get_topology
from hvdx.variables import tf_variable
from hvdx.wrapped import check_not_horovods

if TYPE_CHECKING:  # the transport opens sockets: imported where a DASO run sets up
    from hvdx.transport.ring import GroupTransport

__all__ = ["DASOMethod", "find_daso"]

log = logging.getLogger("hvdx.daso")
HISTORY = 100_000  # actions kept in DASO.history
STATE_KEY = "daso.state"  # the schedule's JSON in a Keras archive (save_own_variables)


def daso_arguments(optimizer: Any, total_epochs: int, warmup_epochs: int = 1, cooldown_epochs: int = 1,
                   max_global_skips: int = 4, *, plateau_patience: int = 2, plateau_threshold: float = 0.05,
                   blocking_wire_dtype: str = "bfloat16", timeout: float = 300.0,
                   schedule_state: Optional[Dict[str, Any]] = None) -> Tuple[Topology, Schedule, Dict[str, Any]]:
    """DASO's arguments checked, before the wrapper around `optimizer` is made.

    Returns:
      (the topology now, the schedule to start from (`schedule_state`'s where given), the
      config: the arguments as Python numbers).
    Raises:
      RuntimeError: without hvdx.init().
      ValueError: a bad argument (naming it), an optimizer already wrapped for data
        parallelism, LARS / LAMB with parallel='slices'.
    """
    if not _initialized():
        raise RuntimeError("hvdx.DASO needs hvdx.init() first (it averages inside nodes and across them)")
    topo = _get_topology()
    _check_wrapped(optimizer)
    blocking_wire_dtype = wire.check_dtype(blocking_wire_dtype, "blocking_wire_dtype").name
    timeout = real(timeout, "timeout", 0, low_open=True, expected="a positive number of seconds")
    schedule = Schedule(total_epochs=total_epochs, warmup_epochs=warmup_epochs, cooldown_epochs=cooldown_epochs,
                        max_global_skips=max_global_skips, num_groups=topo.local_size,
                        plateau=PlateauDetector(patience=plateau_patience, threshold=plateau_threshold))
    config = dict(total_epochs=schedule.total_epochs, warmup_epochs=schedule.warmup_epochs,
                  cooldown_epochs=schedule.cooldown_epochs, max_global_skips=schedule.max_global_skips,
                  plateau_patience=schedule.plateau.patience, plateau_threshold=schedule.plateau.threshold,
                  blocking_wire_dtype=blocking_wire_dtype, timeout=timeout)
    if schedule_state is not None:
        schedule = Schedule.from_state(schedule_state)
    return topo, schedule, config


class DASOMethod(TrainingMethod):
    """DASO (coquelin2021, sec. 3) on an hvdx optimizer wrapper whose process set is the node's:
    node-local gradient averaging every step, global parameter averaging in rotating groups,
    blocking in the first `warmup_epochs` and the last `cooldown_epochs`, non-blocking every B
    steps in between (merged with eq. 1). The public contract is `hvdx.DASO`'s
    (hvdx/daso/optimizer.py); a Keras adapter constructs through `_construct` with its
    Keras' wrapper and routes its step through `_guarded_step`.
    """

    label = "hvdx.DASO"
    same_steps_on_every_rank = True
    needs_every_step = True

    def _construct(self, wrapper: type, optimizer: Any, total_epochs: int, warmup_epochs: int = 1,
                   cooldown_epochs: int = 1, max_global_skips: int = 4, *, name: Optional[str] = None,
                   **options: Any) -> None:
        """The constructor both Keras' DASO share: the arguments checked (`daso_arguments`,
        `options` its keyword-only ones), `wrapper`'s constructor (hvdx's wrapper of that Keras)
        averaging over the node's process set, then DASO's own state."""
        topo, schedule, config = daso_arguments(optimizer, total_epochs, warmup_epochs, cooldown_epochs,
                                                max_global_skips, **options)
        wrapper.__init__(self, optimizer, name=name or f"DASO{type(optimizer).__name__}", communication="allreduce",
                         process_set=topo.local_set)
        self._daso_config = self._no_dependency(dict(config))
        self._topo = topo
        self.schedule = self._for_topology(schedule)
        self._params: Optional[List[tf.Variable]] = None  # set once: a plain list of tf.Variables, not tracked
        self._sync: Optional[ParameterSync] = None
        self._sync_stats = self._no_dependency(SyncStats())  # kept across reset(): every ParameterSync adds to it
        self._close_transport: Optional[weakref.finalize] = None  # closes it, also when this optimizer is collected
        self._reference0: Optional[np.ndarray] = None
        self._flat: Optional[FlatParameters] = None
        self._identical = False  # every rank holds the same parameters right now
        # the last actions taken and schedule events (tests, benchmarks), bounded for long runs
        self.history: Deque[Action] = self._no_dependency(collections.deque(maxlen=HISTORY))
        self.events: Deque[str] = self._no_dependency(collections.deque(maxlen=HISTORY))
        with tf.init_scope():
            self._daso_state = tf.Variable(self.schedule.to_json(), dtype=tf.string, trainable=False,
                                           name="daso_state")
            # steps applied since the last after_step(): a step finding one fails (no DASOCallback)
            self._unsynced = self._no_dependency(tf.Variable(0, dtype=tf.int64, trainable=False,
                                                             name="daso_unsynced_steps"))
        self._state_written = self.schedule.to_json()

    # -- the step (inside the step function) -------------------------------------------
    def _aggregate(self, grads, variables):
        """The wrapper's aggregation hook: the node-local average, none in a node of one rank
        (a wrapped LARS / LAMB then takes this rank's own norms)."""
        if self._topo.local_size == 1:  # a node of one rank: nothing to average locally
            if isinstance(self._core.optimizer, AggregationObserver):  # LARS / LAMB: norms of this rank only
                self._core.optimizer.observe_aggregation(AggregationRecord(tuple(variables), (), self._topo.local_set))
            return list(grads)
        return super()._aggregate(grads, variables)

    def _guarded_step(self, variables: Sequence[Any], apply: Callable[[], Any]) -> Any:
        """Runs the wrapper's step `apply()` (aggregation and update) of `variables` under
        DASO's guard: the first traced step fixes DASO's variables and puts every rank on rank
        0's parameters; a step finding one not followed by `after_step()` fails on every rank
        alike, before the step's collectives. Returns what `apply()` returns.

        Raises:
          ValueError: other variables than the first step's.
          InvalidArgumentError (when run): a second step without after_step() in between.
        """
        variables = [tf_variable(v) for v in variables]
        if self._params is None:
            self._params = self._no_dependency(variables)
            self._start_identical()
        elif [id(v) for v in variables] != [id(v) for v in self._params]:
            raise ValueError("hvdx.DASO averages the variables of its first apply_gradients; a later call "
                             "passed other variables (use one DASO optimizer per model)")
        synced = tf.debugging.assert_equal(
            self._unsynced, tf.constant(0, tf.int64), message=(
                "hvdx.DASO: a step ran without after_step() after the previous one, so no global "
                "synchronisation ran and each node trains its own model. Model.fit needs "
                "callbacks=[hvdx.daso.DASOCallback()] (and steps_per_execution=1); a custom loop calls "
                "opt.after_step() after each step and opt.end_epoch(loss) after each epoch"))
        with tf.control_dependencies([synced]):  # before the step's collectives: every rank fails alike
            applied = apply()
        self._unsynced.assign_add(1)
        return applied

    def _start_identical(self) -> None:
        """Collective, when the step is first traced (before its first run): every rank
        takes rank 0's parameters, which become the blocking phase's x_ref (hvdx.daso.sync).
        A restored checkpoint (drained, so the same on every rank) passes unchanged. One
        buffer under a fixed name: Keras' variable names may differ between ranks (a rank
        that built an extra model), and Horovod pairs collectives by name."""
        with tf.init_scope():
            if not tf.executing_eagerly():
                raise RuntimeError("hvdx.DASO runs with TensorFlow 2's eager runtime (tf.function steps), "
                                   "not in TF1 graphs")
            self._flat = FlatParameters(self._params)
            flat = hvd.broadcast(tf.constant(self._flat.read()), root_rank=0, name="hvdx.daso.initial").numpy()
            self._flat.write(flat)
            self._reference0 = flat
        self._identical = True

    # -- between steps (eager) ---------------------------------------------------------
    def _setup(self) -> None:
        """Collective, at the first step (or at the start after reset()): the ranks agree, take
        rank 0's schedule, the parameter sync and its transport. After reset() every rank
        first takes rank 0's parameters again (they are the blocking phase's x_ref)."""
        if self._params is None:
            raise RuntimeError("after_step() comes after the step's apply_gradients (no variables yet)")
        check_agreement({"DASO": json.dumps(self._daso_config, sort_keys=True),
                         "variables": f"{len(self._params)} of {sum(int(np.prod(v.shape)) for v in self._params)} "
                                      f"elements"},
                        "their DASO optimizer (same arguments, same model on every rank)", "hvdx.daso.setup")
        # rank 0's schedule on every rank: after reset() a process Elastic Horovod added starts
        # with a new schedule, and the ranks must take the same actions at the same steps
        state = hvd.broadcast_object(self.schedule.state(), root_rank=0, name="hvdx.daso.schedule")
        self.schedule = self._for_topology(Schedule.from_state(state))
        self._write_state()
        if self._reference0 is None:  # after reset(): the ranks' parameters may differ
            self._start_identical()
        self._sync = ParameterSync(self._flat, self._topo, self._open_transport(),
                                   wire_dtype=self._daso_config["blocking_wire_dtype"])
        self._sync.stats = self._sync_stats
        self._sync.set_reference(self._reference0)
        self._reference0 = None

    def _open_transport(self) -> "GroupTransport":
        """Collective: one ring per local rank across the nodes, closed by close() or when
        this optimizer is collected."""
        from hvdx.transport.ring import GroupTransport

        topo = self._topo
        groups = [tuple(node[lr] for node in topo.node_ranks) for lr in range(topo.local_size)]
        transport = GroupTransport.create(groups, topo.rank, name="hvdx.daso.transport",
                                          timeout=self._daso_config["timeout"])
        self._close_transport = weakref.finalize(self, transport.close)
        return transport

    def _ensure_transport(self) -> None:
        if self._sync is None:
            self._setup()
        elif self._sync.transport.closed:  # reopened after close(): reference, statistics, schedule go on
            self._sync.transport = self._open_transport()

    def close(self) -> None:
        """Closes the transport between the nodes (its sockets and threads); idempotent, no
        collective, never hangs. Model.fit's end does it (DASOCallback); a step after it opens
        a new one (collective, like the first step). An exchange still in flight then fails its
        merge (TransportError): drain() first, as every epoch's end does (or `finish()`), or
        reset(), which forgets it. An optimizer that is garbage-collected closes its transport
        too."""
        if self._close_transport is not None:
            self._close_transport()

    def _load_state_if_restored(self) -> None:
        """A checkpoint restored into this optimizer brings its schedule with it."""
        text = self._daso_state.numpy().decode()
        if text != self._state_written:
            self.schedule = self._for_topology(Schedule.from_json(text))
            self._write_state()
            self._identical = False

    def _for_topology(self, schedule: Schedule) -> Schedule:
        """`schedule` (restored, perhaps saved on another topology) with its groups planned for
        this job: one group per local rank. A checkpoint is drained (no exchange in flight),
        so only the rotation changes: the next group is `syncs` modulo the new count.

        Raises:
          ValueError: the saved schedule has an exchange in flight and another group count
            (a checkpoint saved without drain(), restored on another topology).
        """
        groups = self._topo.local_size
        if schedule.num_groups == groups:
            return schedule
        if schedule.in_flight:
            raise ValueError(
                f"this DASO checkpoint was saved with a global exchange in flight on {schedule.num_groups} ranks "
                f"per node and is restored on {groups}: save it after opt.drain() on every rank (Model.fit's "
                "epochs end drained) to restore it onto another topology")
        log.info("DASO restored onto %d ranks per node (saved with %d): %d groups now", groups,
                 schedule.num_groups, groups)
        return Schedule.from_state({**schedule.state(), "num_groups": groups})

    def _write_state(self) -> None:
        text = self.schedule.to_json()
        self._daso_state.assign(text)
        self._state_written = text

    def after_step(self) -> Action:
        """Collective, after each step's update: the schedule's global synchronisation."""
        self._ensure_transport()
        self._load_state_if_restored()
        self._unsynced.assign(0)
        action = self.schedule.after_step()
        if self._topo.num_nodes > 1:
            if action.merge_group is not None:
                self._sync.merge(action.staleness)
            if action.start_group is not None:
                self._sync.start(action.start_group, action.step)
            if action.blocking_group is not None:
                self._sync.blocking(action.blocking_group)
        self._identical = action.blocking_group is not None or self._topo.num_nodes == 1
        self.history.append(action)
        return action

    def drain(self) -> Optional[Action]:
        """Collective: merges the exchange in flight and averages over all ranks, so that
        every rank holds the same parameters (before a checkpoint; epochs end with it)."""
        self._ensure_transport()
        action = self.schedule.drain()
        if action is not None and self._topo.num_nodes > 1:
            self._sync.merge(action.staleness)
            if action.staleness == 0:  # started by this very step: the merge is a plain average
                self._identical = True
        if not self._identical and self._topo.num_nodes > 1:
            self._sync.average(self.schedule.syncs % self.schedule.num_groups)
        self._identical = True
        self._write_state()
        return action

    def end_epoch(self, epoch_or_loss, logs: Any = ...) -> List[str]:
        """Collective, after each epoch: drain, then the schedule takes the epoch's training
        loss averaged over all ranks (plateaus, phases). Returns what changed.

        Two forms: `end_epoch(loss)` (custom loops: the epoch's training loss) and the
        lifecycle's `end_epoch(epoch, logs)` (the loss is logs["loss"]; ValueError without
        it: compile the model with a loss)."""
        if logs is ...:
            loss = epoch_or_loss
        else:
            loss = (logs or {}).get("loss")
            if loss is None:
                raise ValueError("hvdx.DASO needs the epoch's training loss in Keras' logs (compile the model "
                                 "with a loss)")
        self.drain()
        loss = float(np.asarray(loss))
        mean = hvd.allreduce(tf.constant([loss], tf.float64), op=hvd.Average, name="hvdx.daso.loss").numpy()[0]
        events = self.schedule.end_epoch(mean)
        self._write_state()
        if events:
            log.info("DASO after epoch %d (loss %.5g): %s", self.schedule.epoch, mean, ", ".join(events))
        self.events.extend(f"epoch {self.schedule.epoch}: {e}" for e in events)
        return events

    def start_epoch(self, epoch: int) -> None:
        """Model.fit's epoch numbers (initial_epoch of a resumed run included)."""
        self._load_state_if_restored()
        if self._sync is not None and (self.schedule.in_flight or not self._identical):
            self.drain()
        self.schedule.start_epoch(epoch)
        self._write_state()

    @property
    def stats(self) -> SyncStats:
        """Seconds spent per kind of synchronisation on this rank (hvdx.daso.sync.SyncStats,
        kept across reset()); calling it, `opt.stats()`, is the lifecycle's summary."""
        return self._sync_stats

    # -- the lifecycle (hvdx.lifecycle.TrainingMethod) ---------------------------------
    def start(self, model_or_variables: Any = None, optimizer: Any = None, *, steps_per_epoch: Optional[int] = None,
              epochs: Optional[int] = None) -> "DASOMethod":
        """Collective where this DASO's variables are known and its transport is not built
        (after reset()): every rank takes rank 0's parameters, the transport opens. In an
        elastic job a built Keras model (`model_or_variables`) makes its trainable variables
        DASO's before the first step, so that a process Elastic Horovod added (which never
        stepped) makes the same collectives here as the ranks that did (every trainable
        variable must then get a gradient). Otherwise nothing: DASO's variables are
        those of its first traced apply_gradients (which broadcasts rank 0's parameters), and
        the first after_step() builds the transport. The arguments are the lifecycle's (DASO
        is its own optimizer). Returns self."""
        if self._params is None and elastic_job() and getattr(model_or_variables, "built", False):
            variables = [tf_variable(v) for v in model_or_variables.trainable_variables]
            if variables:
                self._params = self._no_dependency(variables)
        if self._params is not None and self._sync is None:
            self._setup()
        return self

    def begin_epoch(self, epoch: int) -> bool:
        """`start_epoch(epoch)`; never asks for a new trace."""
        self.start_epoch(epoch)
        return False

    def finish(self) -> None:
        """Collective: `drain()` where an exchange may be pending (every rank then holds the
        same parameters); nothing once drained or closed. Idempotent."""
        if self._sync is not None and not self._sync.transport.closed:
            self.drain()

    def state(self) -> Dict[str, Any]:
        """{"schedule": the schedule's state} (phase, B, W, counters, plateau; JSON)."""
        return {"schedule": self.schedule.state()}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Takes a `state()` back, its groups planned for this job's ranks per node.

        Raises:
          ValueError: the state has an exchange in flight (take it after drain(); epochs
            end drained).
        """
        schedule = Schedule.from_state(state["schedule"])
        if schedule.in_flight:
            raise ValueError("this DASO state was taken with a global exchange in flight: take state() after "
                             "opt.drain() on every rank (Model.fit's epochs end drained)")
        self.schedule = self._for_topology(schedule)
        self._write_state()
        self._identical = False

    def reset(self, topology: Optional[Topology] = None) -> None:
        """The membership changed (default: `hvdx.topology()` now). Without collectives: closes
        the transport, forgets the exchange in flight (the schedule goes on from its position,
        B, W and plateau), averages gradients over the new node's process set from the next
        trace, plans the groups for the new ranks per node. The next start() (or
        after_step()) takes rank 0's parameters and opens a new transport, collectively.
        """
        topology = topology if topology is not None else _get_topology()
        self._aggregator.use_process_set(topology.local_set)
        self.close()
        self._close_transport = None
        self._sync = None
        self._reference0 = None
        self._identical = False
        self._unsynced.assign(0)  # a step interrupted before its after_step() (a host change, a failure)
        self._topo = topology
        self.schedule = self._for_topology(Schedule.from_state(
            {**self.schedule.state(), "pending_group": None, "pending_step": None}))
        self._write_state()

    # -- saving (both Keras' archives, checkpoints and configs) ------------------------
    def _save_schedule(self, store) -> None:
        """Into a Keras archive's store (`save_own_variables`): the schedule's JSON as bytes."""
        store[STATE_KEY] = np.frombuffer(self.schedule.to_json().encode(), np.uint8)

    def _load_schedule(self, store) -> Dict[str, Any]:
        """From a Keras archive's store (`load_own_variables`): takes the schedule back where
        saved, planned for this job's topology; returns the store's other entries (the
        wrapper's own)."""
        keys = list(store.keys())
        if STATE_KEY in keys:
            text = np.asarray(store[STATE_KEY][...], np.uint8).tobytes().decode()
            self.schedule = self._for_topology(Schedule.from_json(text))
            self._write_state()
        return {k: store[k] for k in keys if k != STATE_KEY}

    def _method_config(self) -> Dict[str, Any]:
        """DASO's part of the optimizer's config: the arguments and the schedule's state."""
        return {**self._daso_config, "schedule_state": self.schedule.state()}


def find_daso(optimizer: Any) -> Optional[DASOMethod]:
    """The DASO optimizer (of either Keras) inside `optimizer` (a LossScaleOptimizer may wrap it)."""
    return find_method(optimizer, DASOMethod)


def _check_wrapped(optimizer: Any) -> None:
    """ValueError for Horovod's DistributedOptimizer: it would average every step's gradients
    over all ranks inside DASO's node-local average (synchronous training plus DASO's traffic).
    (hvdx.DistributedOptimizer refuses hvdx's own wrapper itself.)"""
    check_not_horovods(optimizer, "hvdx.DASO", "it would average the gradients over all ranks every step inside "
                       "DASO's node-local average: synchronous training plus DASO's traffic")
    if isinstance(optimizer, AggregationObserver) and getattr(optimizer, "parallel", None) == "slices":
        raise ValueError(
            f"{type(optimizer).__name__}(parallel='slices') needs the slices of a reduce-scattering aggregation "
            "('hierarchical', 'hitopk'); hvdx.DASO averages gradients inside each node with an allreduce, which "
            "leaves none: use parallel='pto' (the norms shared inside the node) or parallel=None")
