"""AD-PSGD on TensorFlow variables: `ADPSGD` for custom `tf.GradientTape` loops and
`ADPSGDCallback` for `Model.fit` (lian2018 Algorithm 1: Lian, Zhang, Zhang, Liu,
"Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML 2018, arXiv
1710.06952).

    gossip = hvdx.adpsgd.ADPSGD(model.trainable_variables, topology="exponential").start()
    for x, y in data:                              # each rank its own number of steps
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))            # the gradient on the local, possibly stale model
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        gossip.step()                              # the update joins the model; averaging goes on
    gossip.finish()                                # every rank holds the average model

    model.fit(..., callbacks=[hvdx.adpsgd.ADPSGDCallback(topology="ring", max_seconds=600)])

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
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvdx.adpsgd.gossip import Gossip
from hvdx.adpsgd.graph import Edges, build_graph
from hvdx.transport.peer import PeerTransport
from hvdx.transport.ring import GroupTransport
from hvdx.wrapped import check_not_synchronous

__all__ = ["ADPSGD", "ADPSGDCallback", "check_optimizer"]


def check_optimizer(optimizer: Any) -> None:
    """ValueError if `optimizer` averages gradients synchronously (an hvdx or Horovod
    DistributedOptimizer, DASO): AD-PSGD replaces that averaging, it does not add to it."""
    check_not_synchronous(optimizer, "AD-PSGD")


class ADPSGD:
    """AD-PSGD over `variables` on this rank (module docstring; the averaging: `Gossip`).

    Args:
      variables: the model's float variables (every rank the same list, in the same order).
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

    Raises ValueError: a non-float variable (named), an empty list, a job of one rank, an
    unknown topology, an `optimizer` that is synchronous, a `cross_node_weight` that is not a
    positive number. RuntimeError: Horovod not initialized, or `cross_node_weight` != 1
    without `hvdx.init()`.
    """

    def __init__(self, variables: Sequence[tf.Variable], *, topology: "str | Callable[[int], Edges]" = "ring",
                 seed: Optional[int] = None, timeout: float = 60.0, finish_timeout: Optional[float] = None,
                 optimizer: Any = None, name: str = "hvdx.adpsgd", step_budget: Optional[int] = None,
                 switch_interval: Optional[float] = 0.001, cross_node_weight: float = 1.0) -> None:
        variables = list(variables)
        if not variables:
            raise ValueError("ADPSGD needs the model's variables, got none (build the model first)")
        for v in variables:
            if not isinstance(v, tf.Variable):
                raise ValueError(f"ADPSGD averages tf.Variables, got {type(v).__name__}")
            if not v.dtype.is_floating:
                raise ValueError(f"variable {v.name!r} is {v.dtype.name}: AD-PSGD averages models, and only "
                                 f"float variables can be averaged; pass the float ones (e.g. "
                                 f"model.trainable_variables) and keep counters out of the list")
        if optimizer is not None:
            check_optimizer(optimizer)
        self.variables = variables
        self.topology = topology
        self.seed, self.timeout, self.finish_timeout, self.name = seed, timeout, finish_timeout, name
        self.step_budget, self.switch_interval = step_budget, switch_interval
        self.cross_node_weight = check_cross_node_weight(cross_node_weight)
        self.gossip: Optional[Gossip] = None
        self._last: Optional[np.ndarray] = None  # what the variables were last given
        self._shapes = [tuple(v.shape) for v in variables]
        self._sizes = [int(np.prod(s)) for s in self._shapes]
        self._dtype = np.float64 if any(v.dtype == tf.float64 for v in variables) else np.float32
        hvd = sys.modules.get("horovod.tensorflow")
        if hvd is None or not hvd.is_initialized():
            raise RuntimeError("ADPSGD needs Horovod initialized: call hvdx.init() first")
        self.rank, self.size = hvd.rank(), hvd.size()
        self.graph = build_graph(topology, self.size)  # ValueError for one rank or an unknown topology
        self.weights = self._weights()

    def start(self) -> "ADPSGD":
        """Collective over all ranks: connects the neighbours and the ring, and starts every
        rank from the same model (the average of the ranks' initial ones, lian2018's X_0 with
        equal columns). Returns self."""
        if self.gossip is not None:
            return self
        peers = PeerTransport.create(list(self.graph.neighbours(self.rank)), self.rank,
                                     name=f"{self.name}.peers", timeout=self.timeout)
        ring_timeout = 3600.0 if self.finish_timeout is None else max(self.timeout, float(self.finish_timeout))
        ring = GroupTransport.create([list(range(self.size))], self.rank, name=f"{self.name}.ring",
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
        try:
            self._assign(self.gossip.average())
        except BaseException:
            self.gossip.close()
            raise
        return self

    def step(self) -> None:
        """After the optimizer applied this rank's gradient: the update joins the model, and
        the variables take the model as averaged so far (wait-free). Raises TransportError
        naming a failed rank."""
        gossip = self._gossip()
        self._assign(gossip.step(self._flat() - self._last))

    @property
    def done(self) -> bool:
        """Whether the steps of all ranks, as far as this rank knows, reached `step_budget`
        (always False without one). Known counts lag the true ones, never exceed them."""
        return self._gossip().done

    def average(self) -> None:
        """Collective: every rank's variables become the average model (before an evaluation or
        a checkpoint); gossip goes on afterwards. Every rank calls it as often."""
        self._assign(self._gossip().average())

    def finish(self) -> None:
        """Collective: the final average on every rank, then the gossip ends (idempotent)."""
        if self.gossip is None or self.gossip._closed:
            return
        try:
            self._assign(self.gossip.average(final=True))
        except BaseException:
            self.gossip.close()  # the switch interval and the sockets, also on an error
            raise

    def close(self) -> None:
        """Ends the gossip without averaging (after an error); idempotent, never hangs."""
        if self.gossip is not None:
            self.gossip.close()

    def stats(self) -> Dict[str, Any]:
        return self._gossip().stats()

    def _weights(self) -> Optional[Dict[int, float]]:
        """Each neighbour's weight: `cross_node_weight` for one on another node, 1 for one on
        this rank's node; None when they are all equal (the uniform choice)."""
        if self.cross_node_weight == 1.0:
            return None
        from hvdx.topology import initialized, topology
        if not initialized():
            raise RuntimeError(f"cross_node_weight={self.cross_node_weight} needs hvdx's topology (which ranks share "
                               f"a node): call hvdx.init() instead of hvd.init()")
        topo = topology()
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
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
        raise ValueError(f"cross_node_weight must be a positive number (1.0: a neighbour on another node as likely "
                         f"as one on this node; 0.25: four times less likely), got {weight!r}")
    return float(weight)


class ADPSGDCallback(tf.keras.callbacks.Callback):
    """AD-PSGD in `Model.fit`: the model's float weights gossip after every batch.

    Args:
      topology, seed, timeout, finish_timeout, switch_interval, cross_node_weight: as `ADPSGD`.
      global_epochs: training ends when all ranks together ran that many epochs of steps:
        global_epochs x the sum over ranks of their steps per epoch (Keras' `steps`; one
        Horovod allreduce at the start), so fast ranks do the slow ones' share (lian2018's
        epochs). Give `fit` enough epochs for the fastest rank (`global_epochs * hvd.size()`
        always is); each rank cycles its own data.
      max_seconds: this rank stops training after that many seconds of `fit` (at the end of a
        batch; the ranks end at their own times), else the epochs end it.
      average_every_epoch: every rank averages at each epoch's end (a collective: callbacks
        after this one, e.g. ModelCheckpoint, see the average model; needs the same number
        of epochs on every rank, so not with `max_seconds`).

    At the end of `fit` every rank holds the average model (`Model.evaluate` and
    `Model.save` are then well defined). `stats` holds the last counts (steps, exchanges).
    """

    def __init__(self, *, topology: "str | Callable[[int], Edges]" = "ring", seed: Optional[int] = None,
                 timeout: float = 60.0, finish_timeout: Optional[float] = None,
                 max_seconds: Optional[float] = None, average_every_epoch: bool = False,
                 name: str = "hvdx.adpsgd", global_epochs: Optional[float] = None,
                 switch_interval: Optional[float] = 0.001, cross_node_weight: float = 1.0) -> None:
        super().__init__()
        if max_seconds is not None and (isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float))
                                        or max_seconds <= 0):
            raise ValueError(f"max_seconds must be a positive number of seconds or None, got {max_seconds!r}")
        if max_seconds is not None and average_every_epoch:
            raise ValueError("average_every_epoch needs the same epochs on every rank; with max_seconds the "
                             "ranks end after different epochs: use one or the other")
        if global_epochs is not None and (isinstance(global_epochs, bool) or not isinstance(global_epochs, (int, float))
                                          or not global_epochs > 0):
            raise ValueError(f"global_epochs must be a positive number of epochs over all ranks or None, got "
                             f"{global_epochs!r}")
        if global_epochs is not None and average_every_epoch:
            raise ValueError("average_every_epoch needs the same epochs on every rank; with global_epochs the fast "
                             "ranks run more epochs than the slow ones: use one or the other")
        self.global_epochs = global_epochs
        self._kwargs = dict(topology=topology, seed=seed, timeout=timeout, finish_timeout=finish_timeout, name=name,
                            switch_interval=switch_interval,
                            cross_node_weight=check_cross_node_weight(cross_node_weight))
        build_graph(topology, 2)  # an unknown topology fails here, before fit
        self.max_seconds, self.average_every_epoch = max_seconds, average_every_epoch
        self.adpsgd: Optional[ADPSGD] = None
        self.stats: Dict[str, Any] = {}
        self._began = 0.0
        self._calls = 0

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        check_optimizer(self.model.optimizer)
        self._calls += 1
        kwargs = dict(self._kwargs)
        kwargs["name"] = f"{kwargs['name']}.{self._calls}"
        variables: List[tf.Variable] = [w for w in self.model.weights if w.dtype.is_floating]
        if self.global_epochs is not None:
            kwargs["step_budget"] = self._budget()
        self.adpsgd = ADPSGD(variables, **kwargs).start()
        self._began = time.monotonic()

    def _budget(self) -> int:
        """global_epochs x the steps per epoch summed over ranks (collective)."""
        steps = self.params.get("steps")
        if not steps:
            raise ValueError("global_epochs needs fit to know its steps per epoch: pass arrays, or a dataset of "
                             "known length, or steps_per_epoch")
        hvd = sys.modules["horovod.tensorflow"]
        total = int(hvd.allreduce(tf.constant([int(steps)], tf.int64), op=hvd.Sum,
                                  name=f"{self._kwargs['name']}.{self._calls}.steps").numpy()[0])
        return max(1, int(round(self.global_epochs * total)))

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        try:
            self.adpsgd.step()
        except BaseException:
            self.adpsgd.close()
            raise
        if self.global_epochs is not None and self.adpsgd.done:
            self.model.stop_training = True
        if self.max_seconds is not None and time.monotonic() - self._began >= self.max_seconds:
            self.model.stop_training = True

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.average_every_epoch and not self.model.stop_training:
            self.adpsgd.average()

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.adpsgd is None:
            return
        self.stats = self.adpsgd.stats()
        if self.global_epochs is not None and not self.adpsgd.done and self.max_seconds is None:
            warnings.warn(f"rank {self.adpsgd.rank}: fit's epochs ended before the ranks' steps reached "
                          f"global_epochs={self.global_epochs} ({sum(self.stats['known_steps'])} of "
                          f"{self.stats['step_budget']} known): give fit more epochs "
                          f"(global_epochs * hvd.size() always suffices)", stacklevel=2)
        try:
            self.adpsgd.finish()
        except BaseException:
            self.adpsgd.close()
            raise
