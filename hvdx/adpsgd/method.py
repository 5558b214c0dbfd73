"""AD-PSGD on TensorFlow variables: `ADPSGD`, an `hvdx.lifecycle.TrainingMethod` (lian2018
Algorithm 1: Lian, Zhang, Zhang, Liu, "Asynchronous Decentralized Parallel Stochastic Gradient
Descent", ICML 2018, arXiv 1710.06952).

    gossip = hvdx.adpsgd.ADPSGD(model.trainable_variables, topology="exponential").start()
    for x, y in data:                              # each rank its own number of steps
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))            # the gradient on the local, possibly stale model
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        gossip.step()                              # the update joins the model; averaging goes on
    gossip.finish()                                # every rank holds the average model

    model.fit(..., callbacks=[hvdx.adpsgd.ADPSGDCallback(topology="ring", max_seconds=600)])
    model.fit(..., callbacks=[hvdx.callbacks.TrainingMethodCallback(hvdx.adpsgd.ADPSGD(topology="ring"))])

An epoch over all ranks' samples (lian2018's setting: fast workers do a slow one's share):

    gossip = hvdx.adpsgd.ADPSGD(variables, step_budget=epochs * total_steps_per_epoch).start()
    while not gossip.done:                         # the steps of all ranks, as far as this rank knows
        ...; gossip.step()                         # (each rank cycles its own shard)
    model.fit(x_shard, y_shard, epochs=epochs * hvd.size(),   # an upper bound: the budget stops it
              callbacks=[hvdx.adpsgd.ADPSGDCallback(global_epochs=epochs)])

The optimizer is the plain Keras one (no hvdx/Horovod DistributedOptimizer: AD-PSGD has no
gradient allreduce); its state (momentum) stays local to the rank.
"""
from __future__ import annotations

import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvdx.adpsgd.gossip import Gossip, check_step_budget
from hvdx.adpsgd.graph import Edges, build_graph
from hvdx.arguments import integer, real
from hvdx.lifecycle import TrainingMethod
from hvdx.topology import Topology, initialized, topology as current_topology
from hvdx.transport.peer import PeerTransport
from hvdx.transport.ring import GroupTransport
from hvdx.variables import tf_variable

__all__ = ["ADPSGD", "check_cross_node_weight", "check_fit_options"]


class ADPSGD(TrainingMethod):
    """AD-PSGD over `variables` on this rank (module docstring; the averaging: `Gossip`).

    Args:
      variables: the model's float variables (every rank the same list, in the same order),
        or None: the model given to `start()` (its float weights).
      topology: "ring", "exponential" (the paper's 2^i + 1 hops) or a function n -> edges
        (`hvdx.adpsgd.graph`).
      seed: the neighbour choice's seed (default: the rank).
      timeout: seconds an exchange or a transfer may take before the peer is reported.
      finish_timeout: seconds `average()`/`finish()` waits for the other ranks (None: as
        long as they are alive; the slowest rank's remaining training time counts).
      name: prefix of the transports' collective names (one per ADPSGD object and job).
      step_budget: the steps all ranks together run (the same on every rank; checked between
        neighbours at the first average); `done` turns True when the steps this rank knows
        of reach it (`Gossip`). None: each rank decides alone.
      switch_interval: Python's thread switch interval while the gossip runs (seconds; None:
        leave it). Process-wide; restored by `finish()`/`close()` (`Gossip`).
      cross_node_weight: how likely an active rank picks a neighbour on another node (hvdx's
        topology: `hvdx.init()`), relative to one on its own node: 1.0 is the paper's uniform
        choice; below 1 exchanges stay inside nodes more often (cheaper, but the nodes' models
        mix more slowly). Measured in benchmarks/README.md (adpsgd.py, "inside and across nodes").
      global_epochs: the step budget in epochs over all ranks: `start(steps_per_epoch=s)`
        sets it to global_epochs x the sum over ranks of s (one Horovod allreduce); `fit`
        passes its steps. Not with `step_budget`.
      max_seconds: `should_stop()` turns True that many seconds after `start()`.
      average_every_epoch: `end_epoch()` averages every rank's model (a collective: every rank
        must end as many epochs, so not with `max_seconds` or `global_epochs`).

    The lifecycle (`hvdx.lifecycle.TrainingMethod`): `start(model_or_variables, optimizer)`;
    `after_step()` is `step()`; `end_epoch()` averages with `average_every_epoch`;
    `should_stop()` (the budget, `max_seconds`); `finish()`; `close()`; `state()` / `restore()`
    (this rank's counts); `reset(topology)`; `stats()`. Ranks run their own numbers of steps
    (`same_steps_on_every_rank` is False); `step()` takes whatever update the optimizer made
    since the last one, so Keras' steps_per_execution may exceed 1.

    Raises ValueError: a non-float variable (named), an empty list, a job of one rank, an
    unknown topology, an `optimizer` that is synchronous, a `cross_node_weight` that is not a
    positive number, options that exclude each other. RuntimeError: Horovod not initialized,
    or `cross_node_weight` != 1 without `hvdx.init()`.
    """

    label = "AD-PSGD"
    same_steps_on_every_rank = False
    needs_every_step = False

    def __init__(self, variables: Optional[Sequence[tf.Variable]] = None, *,
                 topology: "str | Callable[[int], Edges]" = "ring", seed: Optional[int] = None, timeout: float = 60.0,
                 finish_timeout: Optional[float] = None, optimizer: Any = None, name: str = "hvdx.adpsgd",
                 step_budget: Optional[int] = None, switch_interval: Optional[float] = 0.001,
                 cross_node_weight: float = 1.0, global_epochs: Optional[float] = None,
                 max_seconds: Optional[float] = None, average_every_epoch: bool = False) -> None:
        check_fit_options(max_seconds, average_every_epoch, global_epochs)
        if global_epochs is not None and step_budget is not None:
            raise ValueError("give the step budget as step_budget (steps over all ranks) or as global_epochs "
                             "(epochs over all ranks, from the steps per epoch start() gets), not both")
        if optimizer is not None:
            self.check_optimizer(optimizer)
        self.variables: list = []
        if variables is not None:
            self._set_variables(variables)
        self.topology = topology
        step_budget = check_step_budget(step_budget)
        seed = integer(seed, "seed", optional=True)
        self.seed, self.timeout, self.finish_timeout, self.name = seed, timeout, finish_timeout, name
        self.step_budget, self.switch_interval = step_budget, switch_interval
        self._budget_total = step_budget        # the whole run's budget (step_budget, or from global_epochs)
        self.global_epochs, self.max_seconds, self.average_every_epoch = global_epochs, max_seconds, average_every_epoch
        self.cross_node_weight = check_cross_node_weight(cross_node_weight)
        self.gossip: Optional[Gossip] = None
        self._last: Optional[np.ndarray] = None  # what the variables were last given
        self._began = 0.0
        self._runs = 0                            # gossips started: the transports' names
        self._counts = {"steps": 0, "exchanges": 0, "averages": 0}  # of the gossips before the current one
        self._averages = 0                        # of the current gossip
        # after reset(): the next start() goes on with what is left of the budget, from what the
        # ranks agreed at the last start() the steps before it were (over all ranks, departed
        # ones included) and what this rank knew of that gossip's counts when it ended (per
        # rank of that gossip); after restore(): from a checkpoint's own steps
        self._resume = False
        self._ran_before = 0
        self._ran_known: List[int] = []
        self._restored_steps: Optional[int] = None
        self._last_stats: Dict[str, Any] = {}
        hvd = sys.modules.get("horovod.tensorflow")
        if hvd is None or not hvd.is_initialized():
            raise RuntimeError("ADPSGD needs Horovod initialized: call hvdx.init() first")
        self._plan(hvd.rank(), hvd.size())

    def _plan(self, rank: int, size: int, topo: Optional[Topology] = None) -> None:
        """The graph and the neighbour weights for `size` ranks (no collective)."""
        self.rank, self.size = rank, size
        self.graph = build_graph(self.topology, self.size)  # ValueError for one rank or an unknown topology
        self.weights = self._weights(topo)

    def _set_variables(self, variables: Sequence[tf.Variable]) -> None:
        variables = [tf_variable(v) for v in variables]  # a Keras 3 variable: the tf.Variable it holds
        if not variables:
            raise ValueError("ADPSGD needs the model's variables, got none (build the model first)")
        for v in variables:
            if not isinstance(v, tf.Variable):
                raise ValueError(f"ADPSGD averages tf.Variables, got {type(v).__name__}")
            if not v.dtype.is_floating:
                raise ValueError(f"variable {v.name!r} is {v.dtype.name}: AD-PSGD averages models, and only "
                                 f"float variables can be averaged; pass the float ones (e.g. "
                                 f"model.trainable_variables) and keep counters out of the list")
        self.variables = variables
        self._shapes = [tuple(v.shape) for v in variables]
        self._sizes = [int(np.prod(s)) for s in self._shapes]
        self._dtype = np.float64 if any(v.dtype == tf.float64 for v in variables) else np.float32

    # -- the lifecycle ----------------------------------------------------------------------
    def start(self, model_or_variables: Any = None, optimizer: Any = None, *, steps_per_epoch: Optional[int] = None,
              epochs: Optional[int] = None) -> "ADPSGD":
        """Collective over all ranks: connects the neighbours and the ring, and starts every
        rank from the same model (the average of the ranks' initial ones, lian2018's X_0 with
        equal columns). Returns self (at once while the gossip runs).

        Args:
          model_or_variables: a Keras model (its float weights gossip) or variables; None: the
            variables given to the constructor.
          optimizer: checked (a synchronous one is refused, ValueError).
          steps_per_epoch: this rank's steps per epoch (needed with `global_epochs` at the
            first start; a later start without it keeps the budget).
          epochs: unused.
        """
        if optimizer is not None:
            self.check_optimizer(optimizer)
        if self.gossip is not None and not self.gossip._closed:
            return self
        if model_or_variables is not None:
            weights = getattr(model_or_variables, "weights", None)
            self._set_variables([w for w in map(tf_variable, weights) if w.dtype.is_floating] if weights is not None
                                else model_or_variables)
        if not self.variables:
            raise ValueError("ADPSGD needs the model's variables: ADPSGD(variables) or start(model)")
        self._retire()
        if self.global_epochs is not None and steps_per_epoch:  # every rank: fit passes its steps
            self._budget_total = self._budget(steps_per_epoch)
        if self.global_epochs is not None or self._budget_total is not None:  # every rank: the same options
            self.step_budget = self._agree_budget()
        # the transports' names number the gossips started; a process Elastic Horovod added
        # has started none: every rank takes the largest count, so the names match
        hvd = sys.modules["horovod.tensorflow"]
        runs = int(hvd.allreduce(tf.constant([self._runs], tf.int64), op=hvd.Max, name="hvdx.adpsgd.runs")[0])
        name = self.name if runs == 0 else f"{self.name}.run{runs}"
        self._runs = runs + 1
        peers = PeerTransport.create(list(self.graph.neighbours(self.rank)), self.rank,
                                     name=f"{name}.peers", timeout=self.timeout)
        ring_timeout = 3600.0 if self.finish_timeout is None else max(self.timeout, float(self.finish_timeout))
        ring = GroupTransport.create([list(range(self.size))], self.rank, name=f"{name}.ring",
                                     timeout=ring_timeout)
        try:
            self.gossip = Gossip(self._flat(), self.graph, self.rank, peers, ring, seed=self.seed,
                                 timeout=self.timeout, finish_timeout=self.finish_timeout,
                                 switch_interval=self.switch_interval, step_budget=self.step_budget,
                                 weights=self.weights)
        except BaseException:
            peers.close()
            ring.close()
            raise
        self._averages = 0
        try:
            self._assign(self.gossip.average())
        except BaseException:
            self.gossip.close()
            raise
        self._began = time.monotonic()
        return self

    def _budget(self, steps_per_epoch: Optional[int]) -> int:
        """global_epochs x the steps per epoch summed over ranks (collective)."""
        if not steps_per_epoch:
            raise ValueError("global_epochs needs fit to know its steps per epoch: pass arrays, or a dataset of "
                             "known length, or steps_per_epoch")
        hvd = sys.modules["horovod.tensorflow"]
        total = int(hvd.allreduce(tf.constant([int(steps_per_epoch)], tf.int64), op=hvd.Sum,
                                  name=f"{self.name}.steps").numpy()[0])
        return max(1, int(round(self.global_epochs * total)))

    def _agree_budget(self) -> int:
        """Collective: the step budget of the gossip about to start, the same on every rank: the
        run's budget less the steps all ranks ran before. After `restore()` (a checkpoint of the
        same ranks) those are the sum of the ranks' restored counts; otherwise what the ranks
        agreed at the last start plus, per rank of the last gossip, the largest count any rank
        knows (a rank's own count is exact, a departed rank's as last heard): the ranks that
        `reset()`; a process Elastic Horovod added knows none and takes the run's budget from the
        others. A start that follows no reset or restore (a new `fit`) has the whole budget.

        Raises ValueError when no rank knows the run's budget (global_epochs without steps per
        epoch at the first start)."""
        hvd = sys.modules["horovod.tensorflow"]
        rows = hvd.allgather_object({"budget": self._budget_total, "resume": self._resume,
                                     "before": self._ran_before, "known": self._ran_known,
                                     "restored": self._restored_steps}, name=f"{self.name}.budget")
        totals = [r["budget"] for r in rows if r["budget"] is not None]
        if not totals:
            raise ValueError("global_epochs needs fit to know its steps per epoch: pass arrays, or a dataset of "
                             "known length, or steps_per_epoch")
        restored = [r["restored"] for r in rows if r["restored"] is not None]
        resumed = [r for r in rows if r["resume"]]
        ran = 0
        if restored:
            ran = sum(restored)
        elif resumed:
            known = np.zeros((len(resumed), max(len(r["known"]) for r in resumed)), np.int64)
            for i, r in enumerate(resumed):
                known[i, :len(r["known"])] = r["known"]
            ran = max(r["before"] for r in resumed) + int(known.max(axis=0).sum())
        self._budget_total = max(totals)
        self._ran_before, self._ran_known, self._restored_steps, self._resume = ran, [], None, False
        return max(1, self._budget_total - ran)

    def step(self) -> None:
        """After the optimizer applied this rank's gradient: the update joins the model, and
        the variables take the model as averaged so far (wait-free). Raises TransportError
        naming a failed rank."""
        gossip = self._gossip()
        self._assign(gossip.step(self._flat() - self._last))

    def after_step(self) -> None:
        """The lifecycle's name of `step()`."""
        self.step()

    @property
    def resuming(self) -> bool:
        """Whether a membership change `reset()` this method and it has not started since: the
        next `start()` goes on with its counts and what is left of the step budget."""
        return self._resume

    @property
    def done(self) -> bool:
        """Whether the steps of all ranks, as far as this rank knows, reached `step_budget`
        (always False without one). Known counts lag the true ones, never exceed them."""
        return self._gossip().done

    def should_stop(self) -> bool:
        """The step budget is spent (`done`), or `max_seconds` passed since `start()`."""
        if self.step_budget is not None and self.done:
            return True
        return self.max_seconds is not None and time.monotonic() - self._began >= self.max_seconds

    def average(self) -> None:
        """Collective: every rank's variables become the average model (before an evaluation or
        a checkpoint); gossip goes on afterwards. Every rank calls it as often."""
        self._assign(self._gossip().average())
        self._averages += 1

    def end_epoch(self, epoch: int, logs: Optional[Mapping[str, Any]]) -> None:
        """With `average_every_epoch`: `average()` (collective)."""
        if self.average_every_epoch:
            self.average()

    def finish(self) -> None:
        """Collective: the final average on every rank, then the gossip ends (idempotent).
        Warns when `global_epochs` was given and the ranks' steps did not reach it (the
        driver ran out of epochs first)."""
        if self.gossip is None or self.gossip._closed:
            return
        if self.global_epochs is not None and self.max_seconds is None and not self.gossip.done:
            stats = self.gossip.stats()
            warnings.warn(f"rank {self.rank}: fit's epochs ended before the ranks' steps reached "
                          f"global_epochs={self.global_epochs} ({sum(stats['known_steps'])} of "
                          f"{stats['step_budget']} known): give fit more epochs "
                          f"(global_epochs * hvd.size() always suffices)", stacklevel=2)
        try:
            self._assign(self.gossip.average(final=True))
            self._averages += 1
        except BaseException:
            self.gossip.close()  # the switch interval and the sockets, also on an error
            raise

    def close(self) -> None:
        """Ends the gossip without averaging (after an error); idempotent, never hangs."""
        if self.gossip is not None:
            self.gossip.close()

    def stats(self) -> Dict[str, Any]:
        """The gossip's record (`Gossip.stats`: steps, exchanges, partners, known steps,
        budget) of the current or last gossip; {} before any."""
        return self.gossip.stats() if self.gossip is not None else dict(self._last_stats)

    def state(self) -> Dict[str, Any]:
        """This rank's counts over every gossip so far: {"steps", "exchanges", "averages"}."""
        current = self.gossip.stats() if self.gossip is not None else {"steps": 0, "exchanges": 0}
        return {"steps": self._counts["steps"] + current["steps"],
                "exchanges": self._counts["exchanges"] + current["exchanges"],
                "averages": self._counts["averages"] + (self._averages if self.gossip is not None else 0)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Takes back a `state()` (before `start()`): the counts go on from it, and the next
        start() spends only what is left of a step budget (the ranks' restored steps summed:
        every rank restores its own state)."""
        self._counts = {k: int(state[k]) for k in ("steps", "exchanges", "averages")}
        self._restored_steps = self._counts["steps"]

    def reset(self, topology: Optional[Topology] = None) -> None:
        """The membership changed (`topology`; default: Horovod's rank and size now, and
        hvdx's topology where initialized). Without collectives: ends the gossip and closes its
        transports, keeps the counts (`state()`) and the variables (this rank's model), builds
        the graph for the new number of ranks. The next start() connects the new neighbours
        and averages every rank's model (collective)."""
        self._retire()
        self._resume = True
        if topology is None:
            hvd = sys.modules["horovod.tensorflow"]
            self._plan(hvd.rank(), hvd.size())
        else:
            self._plan(topology.rank, topology.size, topology)

    def _retire(self) -> None:
        """Ends the current gossip (no collective) and adds its counts to the committed ones."""
        if self.gossip is None:
            return
        self._counts = self.state()
        self._last_stats = self.gossip.stats()
        self._ran_known = [int(k) for k in self.gossip.known_steps()]
        self.gossip.close()
        self.gossip = None
        self._averages = 0

    # -- the flat model ---------------------------------------------------------------------
    def _weights(self, topo: Optional[Topology] = None) -> Optional[Dict[int, float]]:
        """Each neighbour's weight: `cross_node_weight` for one on another node, 1 for one on
        this rank's node; None when they are all equal (the uniform choice)."""
        if self.cross_node_weight == 1.0:
            return None
        if topo is None:
            if not initialized():
                raise RuntimeError(f"cross_node_weight={self.cross_node_weight} needs hvdx's topology (which ranks "
                                   f"share a node): call hvdx.init() instead of hvd.init()")
            topo = current_topology()
        if topo.size != self.size:
            raise RuntimeError(f"hvdx's topology has {topo.size} ranks, Horovod {self.size}: call hvdx.init() "
                               f"after hvd.init() with the same ranks")
        mine = set(topo.node_ranks[topo.node])
        weights = {p: 1.0 if p in mine else self.cross_node_weight for p in self.graph.neighbours(self.rank)}
        return None if len(set(weights.values())) == 1 else weights

    def _gossip(self) -> Gossip:
        if self.gossip is None:
            raise RuntimeError("call ADPSGD.start() first (collective over all ranks)")
        return self.gossip

    def _flat(self) -> np.ndarray:
        return np.concatenate([np.ravel(v.numpy()).astype(self._dtype, copy=False) for v in self.variables])

    def _assign(self, flat: np.ndarray) -> None:
        offset = 0
        for v, shape, size in zip(self.variables, self._shapes, self._sizes):
            v.assign(flat[offset:offset + size].reshape(shape).astype(v.dtype.as_numpy_dtype, copy=False))
            offset += size
        self._last = np.asarray(flat, self._dtype).copy()


def check_cross_node_weight(weight: Any) -> float:
    """`weight` as a float; ValueError unless it is a positive finite number."""
    return real(weight, "cross_node_weight", 0, float("inf"), low_open=True, high_open=True, expected=(
        "a positive number (1.0: a neighbour on another node as likely as one on this node; 0.25: four times less "
        "likely)"))


def check_fit_options(max_seconds: Optional[float], average_every_epoch: bool,
                      global_epochs: Optional[float]) -> None:
    """ValueError for a bad `max_seconds` / `global_epochs`, or for `average_every_epoch` with
    either (it needs the same epochs on every rank). No Horovod needed."""
    real(max_seconds, "max_seconds", 0, low_open=True, optional=True, expected="a positive number of seconds or None")
    if max_seconds is not None and average_every_epoch:
        raise ValueError("average_every_epoch needs the same epochs on every rank; with max_seconds the "
                         "ranks end after different epochs: use one or the other")
    real(global_epochs, "global_epochs", 0, low_open=True, optional=True,
         expected="a positive number of epochs over all ranks or None")
    if global_epochs is not None and average_every_epoch:
        raise ValueError("average_every_epoch needs the same epochs on every rank; with global_epochs the fast "
                         "ranks run more epochs than the slow ones: use one or the other")
