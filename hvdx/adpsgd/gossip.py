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

- an active rank's gossip thread, once per local step (coalesced when the network is
  slower than the steps), snapshots s = x, sends it to a random passive neighbour p and, on
  the answer x_p, sets x <- x + (x_p - s) / 2 (on the service thread);
- a passive rank answers on its service thread, atomically under the lock: it replies with
  its x_p and sets x_p <- (x_p + s) / 2.

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
import threading
import time
from typing import Any, Dict, Optional

import numpy as np

from hvdx.adpsgd.graph import Graph
from hvdx.transport.base import TransportError
from hvdx.transport.peer import PeerTransport, encode_notice
from hvdx.transport.ring import GroupTransport

__all__ = ["Gossip"]


class Gossip:
    """One rank's side of AD-PSGD on a flat float32/float64 model (module docstring).

    Args:
      model: the initial model, 1-D float32 or float64 (copied).
      graph: the communication graph (`build_graph`); this rank is active or passive in it.
      rank: this rank.
      peers: a `PeerTransport` connected to `graph.neighbours(rank)`.
      ring: a `GroupTransport` over all ranks (one group) for the averages.
      seed: the neighbour choice's random seed (default: the rank).
      timeout: seconds an exchange may take before the neighbour is reported as failed.
      finish_timeout: seconds a rank waits in `average()` for the others to arrive (None:
        as long as they are alive).
    """

    def __init__(self, model: np.ndarray, graph: Graph, rank: int, peers: PeerTransport, ring: GroupTransport,
                 *, seed: Optional[int] = None, timeout: float = 60.0,
                 finish_timeout: Optional[float] = None) -> None:
        if not isinstance(model, np.ndarray) or model.ndim != 1 or model.dtype not in (np.float32, np.float64):
            raise ValueError(f"model must be a 1-D float32 or float64 numpy array, got "
                             f"{getattr(model, 'dtype', type(model).__name__)} {getattr(model, 'shape', '')}")
        if set(peers.peers) != set(graph.neighbours(rank)):
            raise ValueError(f"the transport connects rank {rank} to {list(peers.peers)}, the graph to "
                             f"{list(graph.neighbours(rank))}")
        self.graph, self.rank, self.peers, self.ring = graph, rank, peers, ring
        self.active = graph.is_active(rank)
        self.neighbours = graph.neighbours(rank)
        self.timeout, self.finish_timeout = float(timeout), finish_timeout
        self._x = model.copy()
        self._lock = threading.Lock()          # the model: held for one vector operation at a time
        self._cv = threading.Condition()       # the gossip thread's state
        self._pending = 0
        self._pausing = False
        self._idle = True
        self._stop = False
        self._paused_by: Dict[int, Any] = {}   # passive: neighbour -> the pause it announced
        self._generation = 0
        self._rng = random.Random(rank if seed is None else seed)
        self.steps = 0
        self.exchanges = 0                     # exchanges this rank took part in (started or answered)
        self.partners: Dict[int, int] = {p: 0 for p in self.neighbours}
        self._closed = False
        peers.set_handler(self._answer)
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
        with self._cv:
            self._pending += 1
            self._cv.notify_all()
        return out

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
        tag = {"generation": self._generation, "final": bool(final)}
        deadline = None if self.finish_timeout is None else time.monotonic() + self.finish_timeout
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
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.timeout + 5)
        self.peers.close()
        self.ring.close()

    def stats(self) -> Dict[str, Any]:
        """Steps, exchanges (started or answered), exchanges per neighbour, the role."""
        return {"rank": self.rank, "active": self.active, "steps": self.steps, "exchanges": self.exchanges,
                "partners": {str(k): v for k, v in self.partners.items()}}

    # ------------------------------------------------------------------ transport threads
    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _gossip_loop(self) -> None:
        """Active ranks: one exchange per local step, with a random passive neighbour."""
        while True:
            with self._cv:
                while (self._pending == 0 or self._pausing) and not self._stop and self.failure is None:
                    self._idle = True
                    self._cv.notify_all()
                    self._cv.wait()
                if self._stop or self.failure is not None:
                    self._idle = True
                    self._cv.notify_all()
                    return
                self._pending = 0
                self._idle = False
            peer = self._rng.choice(self.neighbours)
            snapshot = self.model()
            request = self.peers.exchange(peer, snapshot, lambda theirs, s=snapshot, p=peer: self._merge(s, theirs, p))
            try:
                request.wait(self.timeout)
            except TimeoutError:
                self.peers.fail(TransportError(f"rank {peer} did not answer rank {self.rank}'s exchange within "
                                               f"{self.timeout} s (it is stuck or its network is)"))
            except TransportError:
                pass  # recorded on the transport; step() raises it

    def _merge(self, snapshot: np.ndarray, theirs: np.ndarray, peer: int) -> None:
        """Active side: x <- x + (x_p - s) / 2 (the average of s and x_p, plus what happened since s)."""
        with self._lock:
            self._x += (theirs - snapshot) * 0.5
        self.exchanges += 1
        self.partners[peer] += 1

    def _answer(self, peer: int, theirs: np.ndarray) -> np.ndarray:
        """Passive side, atomic: reply with x_p, set x_p <- (x_p + s) / 2."""
        with self._lock:
            mine = self._x.copy()
            self._x += (theirs - mine) * 0.5
        self.exchanges += 1
        self.partners[peer] += 1
        return mine

    def _notice(self, peer: int, body: bytes) -> None:
        message = json.loads(body.decode("utf-8"))
        if "pause" in message:
            with self._cv:
                self._paused_by[peer] = message["pause"]
                self._cv.notify_all()


def _describe(tag: Dict[str, Any]) -> str:
    return "the final average" if tag.get("final") else f"average #{tag.get('generation')}"
