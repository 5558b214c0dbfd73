"""AD-PSGD's averaging on one rank, on a flat model (lian2018 Algorithm 1 and Appendix A: Lian,
Zhang, Zhang, Liu, "Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML
2018, arXiv 1710.06952). No TensorFlow here: `hvdx.adpsgd.keras` puts variables on it.

The rank's model x lives in a buffer owned by this object. The computation (the caller's
thread) computes a gradient on its copy x^ of the model, which may be stale, and hands
`step()` the change its optimizer made to that copy (the paper's x <- x - gamma * grad F(x^), Algorithm 1
line 6, with any Keras optimizer's rule); `step()` adds it to x under a lock held for one
vector add and returns x, and never waits for the network (wait-free). Averaging (Algorithm
1 line 5, x_a, x_p <- (x_a + x_p) / 2 with a random neighbour) runs on the transport's
threads:

- an active rank, once per local step (coalesced when the network is slower than the
  steps), snapshots s = x, sends it to a random passive neighbour p and, on the answer x_p,
  sets x <- x + (x_p - s) / 2 (on the service thread, which also starts the next exchange if
  a step was made meanwhile; the gossip thread starts one after an idle spell and watches
  the time an exchange takes);
- a passive rank answers on its service thread, atomically under the lock: it replies with
  its x_p and sets x_p <- (x_p + s) / 2.

Keeping up with the computation: these are Python threads, and a training loop that holds
the GIL (Keras' per-step Python) lets them run only at the interpreter's thread switches.
Each exchange therefore takes few hand-overs of the GIL (frames written directly by the
thread that builds them, one read for a frame's header and one for the rest, the next
exchange started where the last one ends), and `switch_interval` shortens the interval at
which a waiting thread gets the GIL (`_shorten_switch_interval`).

A global budget of steps (`step_budget`, lian2018's setting: an epoch is counted over all
workers' samples, so fast workers do a slow worker's share): every exchange frame carries the
sender's latest known step counts of every rank (the element-wise maximum of what it heard),
and `done` says when their sum reaches the budget. Known counts never exceed true ones, so
the ranks together run at least the budget; they overshoot by the steps made while the news
travels (a few exchanges per graph hop).

Gradient updates that land on the active rank between its snapshot and the answer stay in
x (they are not lost), and the sum x_a + x_p is preserved exactly: the exchange applies the
doubly stochastic W of lian2018 eq. 2 to (s, x_p) and then the updates made meanwhile.

`average()` / `finish()`: every rank's model replaced by the mean over all ranks (one ring
allreduce), after the gossip is quiescent: each active rank finishes its exchange in flight
and tells its passive neighbours it has paused; a passive rank waits for every active
neighbour's pause, then holds new exchanges until the average is in place.
"""
from __future__ import annotations

import json
import random
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np

from hvdx import timeline
from hvdx.adpsgd.graph import Graph
from hvdx.arguments import integer, real
from hvdx.transport.base import TransportError
from hvdx.transport.peer import PeerTransport, encode_notice
from hvdx.transport.ring import GroupTransport

__all__ = ["Gossip", "check_step_budget"]


def check_step_budget(step_budget: Optional[int]) -> Optional[int]:
    """`step_budget` (steps over all ranks) as a Python int >= 1, or None; ValueError otherwise."""
    return integer(step_budget, "step_budget", 1, optional=True,
                   expected="a positive int (steps over all ranks) or None")


class Gossip:
    """One rank's side of AD-PSGD on a flat float32/float64 model (module docstring).

    Args:
      model: the initial model, 1-D float32 or float64 (copied).
      graph: the communication graph (`build_graph`); this rank is active or passive in it.
      rank: this rank.
      peers: a `PeerTransport` connected to `graph.neighbours(rank)`.
      ring: a `GroupTransport` over all ranks (one group) for the averages.
      seed: the neighbour choice's random seed (default: the rank).
      weights: an active rank's relative probability of picking each neighbour, {rank:
        weight > 0} for every neighbour (None: uniform, lian2018 Algorithm 1 line 5). Any
        positive weights keep each exchange doubly stochastic (eq. 2) and every edge in use;
        they change how often each edge mixes (e.g. `cross_node_weight` of `ADPSGD`).
      finish_timeout: seconds a rank waits in `average()` for the others to arrive (None:
        as long as they are alive).
      switch_interval: while the gossip runs, Python's thread switch interval (seconds,
        `sys.setswitchinterval`), restored by `close()`; None leaves it alone. Process-wide
        (every thread of the process switches as often; `_shorten_switch_interval`).
      step_budget: the number of steps all ranks together run (every rank the same value);
        `done` turns True once the steps this rank knows of reach it. None: no budget.
    """

    def __init__(self, model: np.ndarray, graph: Graph, rank: int, peers: PeerTransport, ring: GroupTransport,
                 *, seed: Optional[int] = None, timeout: float = 60.0,
                 finish_timeout: Optional[float] = None, switch_interval: Optional[float] = 0.001,
                 step_budget: Optional[int] = None, weights: Optional[Dict[int, float]] = None) -> None:
        step_budget = check_step_budget(step_budget)
        seed = integer(seed, "seed", optional=True)
        switch_interval = real(switch_interval, "switch_interval", 0, 1, low_open=True, optional=True,
                               expected="seconds in (0, 1] (e.g. 0.001) or None to leave Python's alone")
        if not isinstance(model, np.ndarray) or model.ndim != 1 or model.dtype not in (np.float32, np.float64):
            raise ValueError(f"model must be a 1-D float32 or float64 numpy array, got "
                             f"{getattr(model, 'dtype', type(model).__name__)} {getattr(model, 'shape', '')}")
        if set(peers.peers) != set(graph.neighbours(rank)):
            raise ValueError(f"the transport connects rank {rank} to {list(peers.peers)}, the graph to "
                             f"{list(graph.neighbours(rank))}")
        self.graph, self.rank, self.peers, self.ring = graph, rank, peers, ring
        self.active = graph.is_active(rank)
        self.neighbours = graph.neighbours(rank)
        self.weights = _check_weights(weights, self.neighbours, rank)
        self.timeout, self.finish_timeout = float(timeout), finish_timeout
        self._x = model.copy()
        self._lock = threading.Lock()          # the model: held for one vector operation at a time
        self._cv = threading.Condition()       # the gossip thread's state
        self._pending = 0
        self._pausing = False
        self._idle = True
        self._stop = False
        self._inflight: Optional[tuple] = None  # active: (neighbour, time.monotonic()) of the exchange in flight
        self._exchange_began: Optional[tuple] = None  # (neighbour, hvdx.timeline.now_us()) of the last exchange
        self.step_budget = step_budget
        self._known = np.zeros(graph.size, np.int64)  # the latest step count heard of, per rank
        self._known_lock = threading.Lock()
        self._paused_by: Dict[int, Any] = {}   # passive: neighbour -> the pause it announced
        self._generation = 0
        self._rng = random.Random(rank if seed is None else seed)
        self.steps = 0
        self.exchanges = 0                     # exchanges this rank took part in (started or answered)
        self.partners: Dict[int, int] = {p: 0 for p in self.neighbours}
        self._closed = False
        self._switching: Optional[float] = switch_interval
        if self._switching is not None:
            _shorten_switch_interval(self._switching)
        peers.set_piggyback(self._counts_out, self._counts_in)
        peers.set_handler(self._answer, direct=True)
        peers.set_notice_handler(self._notice)
        peers.on_failure(lambda error: self._wake())
        self._thread: Optional[threading.Thread] = None
        if self.active:
            self._thread = threading.Thread(target=self._gossip_loop, name=f"hvdx-adpsgd-gossip-{rank}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ computation side
    @property
    def failure(self) -> Optional[TransportError]:
        return self.peers.failure

    def step(self, update: np.ndarray) -> np.ndarray:
        """Adds this rank's update (the optimizer's change to the caller's copy since the
        model was last handed out: -gamma * grad F(x^) for SGD) to the model and returns the
        model (a new array: copy it into the caller's variables).

        Never waits for the network. Raises the transport's TransportError (naming the failed
        rank) once a failure is known.
        """
        self.peers.check()
        with self._lock:
            self._x += update
            out = self._x.copy()
        self.steps += 1
        self._known[self.rank] = self.steps
        with self._cv:
            self._pending += 1
            if self._idle:  # an exchange in flight starts the next one itself when it ends
                self._cv.notify_all()
        return out

    def known_steps(self) -> np.ndarray:
        """The latest step count this rank heard of, per rank (its own: exact; the others':
        at most their true counts, as of their last news)."""
        with self._known_lock:
            return self._known.copy()

    @property
    def done(self) -> bool:
        """Whether the steps this rank knows of, over all ranks, reached `step_budget` (False
        without a budget)."""
        return self.step_budget is not None and int(self._known.sum()) >= self.step_budget

    def idle(self) -> bool:
        """Whether no exchange this rank starts is in flight or due (always True when passive)."""
        with self._cv:
            return not self.active or (self._idle and self._pending == 0)

    def model(self) -> np.ndarray:
        """A copy of the current model."""
        with self._lock:
            return self._x.copy()

    def average(self, *, final: bool = False) -> np.ndarray:
        """Collective over all ranks: every model replaced by the mean of all models; returns it.

        Every rank must call it the same number of times with the same `final` (checked
        between neighbours: ValueError naming both ranks otherwise). Ranks that call it at
        different times wait for each other (gossip goes on with the ranks still training).
        With `final`, the gossip ends. Raises TransportError naming the failed rank.
        """
        self._generation += 1
        tag = {"generation": self._generation, "final": bool(final), "budget": self.step_budget}
        deadline = None if self.finish_timeout is None else time.monotonic() + self.finish_timeout
        counts = encode_notice(counts=self.known_steps().tolist())
        for p in self.neighbours:  # news of this rank's last steps, also to neighbours that are still training
            self.peers.notify(p, counts)
        if self.active:
            with self._cv:
                self._pausing = True
                self._cv.notify_all()
                while not self._idle and self.failure is None:
                    self._cv.wait(0.1)
            self.peers.check()
            for p in self.neighbours:
                self.peers.notify(p, encode_notice(pause=tag))
        else:
            with self._cv:
                while len(self._paused_by) < len(self.neighbours) and self.failure is None:
                    if deadline is not None and time.monotonic() > deadline:
                        missing = sorted(set(self.neighbours) - set(self._paused_by))
                        raise TransportError(f"rank {self.rank}: rank(s) {missing} did not reach the average "
                                             f"within {self.finish_timeout} s")
                    self._cv.wait(0.1)
                announced, self._paused_by = dict(self._paused_by), {}
            self.peers.check()
            for p, theirs in announced.items():
                if theirs.get("budget") != tag["budget"]:
                    raise ValueError(f"ranks disagree on the step budget: rank {self.rank} has {tag['budget']}, its "
                                     f"neighbour rank {p} {theirs.get('budget')} (give every rank the same "
                                     f"step_budget / global_epochs)")
                if theirs != tag:
                    raise ValueError(f"ranks disagree on the average: rank {self.rank} is at "
                                     f"{_describe(tag)}, its neighbour rank {p} at {_describe(theirs)} (every "
                                     f"rank must average as often, e.g. the same epochs with average_every_epoch)")
            self.peers.hold()
        mean = self._allreduce_mean(self.model(), deadline)
        with self._lock:
            self._x[...] = mean
        if final:
            self.close()
            return mean
        if self.active:
            with self._cv:
                self._pausing = False
                self._cv.notify_all()
        else:
            self.peers.release()
        return mean

    def _allreduce_mean(self, x: np.ndarray, deadline: Optional[float]) -> np.ndarray:
        request = self.ring.allreduce_sum(x)
        while not request.done():
            if self.failure is not None:  # a rank died during training: the gossip knows who
                self.ring.close()
                raise self.failure
            if deadline is not None and time.monotonic() > deadline:
                self.ring.close()
                raise TransportError(f"rank {self.rank}: the average over all ranks did not complete within "
                                     f"{self.finish_timeout} s")
            try:
                request.wait(0.1)
            except TimeoutError:
                pass
            except TransportError:
                if self.failure is not None:
                    raise self.failure
                raise
        return request.wait(0) / self.graph.size

    def close(self) -> None:
        """Stops the gossip and closes both transports; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(self.timeout + 5)
            self.peers.close()
            self.ring.close()
        finally:
            if self._switching is not None:
                _restore_switch_interval(self._switching)
                self._switching = None

    def stats(self) -> Dict[str, Any]:
        """Steps, exchanges (started or answered), exchanges per neighbour, the role, the step
        counts known of every rank and the budget."""
        return {"rank": self.rank, "active": self.active, "steps": self.steps, "exchanges": self.exchanges,
                "partners": {str(k): v for k, v in self.partners.items()},
                "known_steps": self.known_steps().tolist(), "step_budget": self.step_budget}

    # ------------------------------------------------------------------ transport threads
    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _gossip_loop(self) -> None:
        """Active ranks: starts an exchange when a step was made and none is in flight (the
        end of an exchange starts the next one itself: `_exchange_done`), and reports a
        neighbour that does not answer within `timeout`."""
        while True:
            stuck = None
            with self._cv:
                while True:
                    if self._stop or self.failure is not None:
                        self._idle = True
                        self._cv.notify_all()
                        return
                    if self._claim():
                        break
                    if self._inflight is not None and time.monotonic() - self._inflight[1] > self.timeout:
                        stuck = self._inflight[0]
                        break
                    self._cv.wait(0.5 if self._inflight is not None else None)
            if stuck is not None:
                self.peers.fail(TransportError(f"rank {stuck} did not answer rank {self.rank}'s exchange within "
                                               f"{self.timeout} s (it is stuck or its network is)"))
                continue
            self._launch()

    def _claim(self) -> bool:
        """With `_cv` held: whether an exchange is due and may start now (then it is in flight)."""
        if self._idle and self._pending > 0 and not self._pausing and not self._stop and self.failure is None:
            self._pending = 0
            self._idle = False
            return True
        return False

    def _launch(self) -> None:
        """Starts one exchange with a random passive neighbour (after `_claim`)."""
        if self.weights is None:
            peer = self._rng.choice(self.neighbours)
        else:
            peer = self._rng.choices(self.neighbours, self.weights)[0]
        snapshot = self.model()
        self._inflight = (peer, time.monotonic())
        self._exchange_began = (peer, timeline.now_us())
        request = self.peers.exchange(peer, snapshot, lambda theirs: self._merge(snapshot, theirs, peer), direct=True)
        request.add_done_callback(self._exchange_done)

    def _exchange_done(self, request: Any) -> None:
        """An exchange ended (answered, or failed): the next one starts at once if a step was
        made meanwhile (on this thread, the service thread as a rule), else the rank is idle."""
        began = self._exchange_began
        if began is not None:
            timeline.record("adpsgd", "gossip", f"exchange with rank {began[0]}", began[1], timeline.now_us())
        with self._cv:
            self._inflight = None
            self._idle = True
            chain = request.error is None and self._claim()
            if not chain:
                self._cv.notify_all()
        if chain:
            self._launch()

    def _merge(self, snapshot: np.ndarray, theirs: np.ndarray, peer: int) -> None:
        """Active side: x <- x + (x_p - s) / 2 (the average of s and x_p, plus what happened since s)."""
        np.subtract(theirs, snapshot, out=snapshot)  # the snapshot was sent (its answer is here): reuse it
        snapshot *= 0.5
        with self._lock:
            self._x += snapshot
        self.exchanges += 1
        self.partners[peer] += 1

    def _answer(self, peer: int, theirs: np.ndarray) -> np.ndarray:
        """Passive side, atomic: reply with x_p, set x_p <- (x_p + s) / 2."""
        with self._lock:
            mine = self._x.copy()
            self._x += theirs
            self._x *= 0.5
        self.exchanges += 1
        self.partners[peer] += 1
        return mine

    def _counts_out(self, peer: int) -> bytes:
        with self._known_lock:
            return self._known.tobytes()

    def _counts_in(self, peer: int, data: bytes) -> None:
        theirs = np.frombuffer(data, np.int64)
        if theirs.size == self._known.size:
            with self._known_lock:
                np.maximum(self._known, theirs, out=self._known)
                self._known[self.rank] = self.steps  # the computation may have counted a step meanwhile

    def _notice(self, peer: int, body: bytes) -> None:
        message = json.loads(body.decode("utf-8"))
        if "counts" in message:
            self._counts_in(peer, np.asarray(message["counts"], np.int64).tobytes())
        if "pause" in message:
            with self._cv:
                self._paused_by[peer] = message["pause"]
                self._cv.notify_all()


# -- the GIL's switch interval, process-wide ---------------------------------------------------------
# The exchanges run on Python threads (the gossip thread, the transport's service and sender
# threads); an exchange hands the GIL between them about six times. When the training loop
# holds the GIL (Keras' per-step Python), a thread that wants it waits up to the switch
# interval (Python's default 5 ms) each time, so an exchange takes ~30 ms of waiting and the
# gossip falls far behind steps of a few ms. A 1 ms interval cuts that wait five-fold. It is a
# setting of the whole interpreter: every thread of the process switches as often while any
# Gossip is open (Gossips of one process share it: the shortest asked for applies, and the
# value before the first one is restored when the last one closes).
_switch_lock = threading.Lock()
_switch_users: List[float] = []
_switch_saved: Optional[float] = None


def _check_weights(weights: Optional[Dict[int, float]], neighbours: tuple, rank: int) -> Optional[List[float]]:
    """The weights of `neighbours` in their order, or None (uniform); ValueError naming what is wrong."""
    if weights is None:
        return None
    if not isinstance(weights, dict) or set(weights) != set(neighbours):
        raise ValueError(f"weights must give every neighbour of rank {rank} ({list(neighbours)}) a weight, got "
                         f"{weights!r}")
    out = []
    for p in neighbours:
        w = weights[p]
        out.append(real(w, f"rank {rank}'s weight of neighbour {p}", 0, float("inf"), low_open=True, high_open=True,
                        expected="a positive finite number (a zero weight would drop the edge and could cut the "
                                 "graph)"))
    return out


def _shorten_switch_interval(seconds: float) -> None:
    global _switch_saved
    with _switch_lock:
        if not _switch_users:
            _switch_saved = sys.getswitchinterval()
        _switch_users.append(seconds)
        sys.setswitchinterval(min(min(_switch_users), _switch_saved))


def _restore_switch_interval(seconds: float) -> None:
    with _switch_lock:
        if seconds in _switch_users:
            _switch_users.remove(seconds)
        if _switch_users:
            sys.setswitchinterval(min(min(_switch_users), _switch_saved))
        elif _switch_saved is not None:
            sys.setswitchinterval(_switch_saved)


def _describe(tag: Dict[str, Any]) -> str:
    return "the final average" if tag.get("final") else f"average #{tag.get('generation')}"
