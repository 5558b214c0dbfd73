"""The progress watchdog: a job whose ranks stop making progress in hvdx's collectives says
which rank waits in which call, and ends, instead of hanging.

`hvdx.init()` starts it on every rank of a job of two or more ranks (`resolve_timeout`: its
bound, `$HVDX_STALL_TIMEOUT_SECONDS`, default `DEFAULT_TIMEOUT`; 0 turns it off). It has:

- the progress marks of every strategy call (`hvdx.progress`), turned on;
- a side channel beside Horovod (whose background thread is the one that waits): each rank
  listens on a TCP port of its own (`hvdx.transport.base.listen_address`), learned by the
  others through `hvdx.init()`'s one all-gather, and answers on a thread of its own:
  "state" (its counters and where its main thread is), "final" (a peer's state as it
  exits, kept), "abort" (another rank ended the job: report, acknowledge, and exit once the
  reporting rank hangs up, so that no rank's exit tears down Horovod's connections of a rank
  that has not yet said why it ends);
- a monitor thread that polls two numbers of the progress table every `poll` seconds; when
  this rank has been inside a collective call and no mark has run for longer than the
  bound, it asks every rank for its state, prints the report (`hvdx.stall.stall_report`) on
  stderr, tells every rank to end, and ends the process with `EXIT_CODE`. A rank that is
  slow but keeps completing calls resets the clock of the ranks that wait for it: the bound
  is on the time without progress, not on the step;
- a `sys.excepthook` that, for an error of Horovod's that a rank's disagreeing collective
  calls cause ("Mismatched data types", "Process set does not exist"), asks the ranks for
  their states and prints which rank ran how many calls (`hvdx.stall.mismatch_report`).

Nothing runs per step beside the marks; the threads sleep between polls.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from hvdx import progress, stall
from hvdx.arguments import real
from hvdx.transport.base import listen_address

__all__ = ["DEFAULT_TIMEOUT", "ENV", "EXIT_CODE", "Watchdog", "current", "resolve_timeout"]

#: The bound's environment variable: seconds a rank may wait in a collective call without
#: progress; 0 turns the watchdog off.
ENV = "HVDX_STALL_TIMEOUT_SECONDS"
#: The bound when neither `hvdx.init(stall_timeout=...)` nor $HVDX_STALL_TIMEOUT_SECONDS sets
#: one: longer than a step, an evaluation or a checkpoint of one rank usually takes.
DEFAULT_TIMEOUT = 300.0
#: The exit code of a process the watchdog ends.
EXIT_CODE = 70
#: Horovod's errors that ranks making different collective calls cause.
HOROVOD_MISMATCH_MARKERS = ("Mismatched", "Process set does not exist", "has not been registered",
                            "shut down", "HorovodInternalError")
#: Seconds a side-channel request waits for a peer (connect, send, answer).
REQUEST_TIMEOUT = 3.0
#: Seconds a rank that ends the job waits for the others to acknowledge (to have written why
#: they end) before it exits.
ABORT_WAIT = 5.0

_current: Optional["Watchdog"] = None


def resolve_timeout(value: Optional[float] = None) -> float:
    """The watchdog's bound in seconds: `value` (hvdx.init's `stall_timeout`) if given, else
    $HVDX_STALL_TIMEOUT_SECONDS, else DEFAULT_TIMEOUT; 0 means off.

    Raises:
      ValueError: a negative or non-numeric value, naming where it came from.
    """
    if value is not None:
        return real(value, "stall_timeout", 0, float("inf"), expected="seconds >= 0 (0: off)")
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"${ENV}={text!r}: give the seconds a rank may wait in a collective without progress "
                         f"(e.g. {DEFAULT_TIMEOUT:g}), or 0 to turn the watchdog off")
    return seconds


def current() -> Optional["Watchdog"]:
    """The running watchdog of this process (None: off, or hvdx.init() not called)."""
    return _current


#: hvdx's package folder (with a trailing separator): where hvdx's own frames are.
_SELF = os.path.abspath(__file__)
_PACKAGE = os.path.dirname(_SELF) + os.sep


def _main_thread_place() -> str:
    """Where the main thread is: the innermost frame of the user's code, then the innermost
    (at most two) of hvdx's below it; other libraries' and the standard library's left out."""
    frame = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001 - a diagnostic
    if frame is None:
        return "unknown"
    skipped = tuple(p for p in {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")} if p)
    user, ours = None, []
    for entry in traceback.extract_stack(frame):
        name = entry.filename
        text = f"{os.path.basename(name)}:{entry.lineno} in {entry.name}"
        # hvdx's frames by its package's folder, not by a folder named hvdx: a checkout named
        # hvdx holds the user's scripts and a venv (TensorFlow's, Horovod's frames) too
        if os.path.abspath(name).startswith(_PACKAGE):
            if os.path.abspath(name) != _SELF:
                ours.append(text)
        elif not ("-packages" in name or name.startswith(skipped) or name.startswith("<")):
            user, ours = text, []
    places = ([user] if user else []) + ours[-2:]
    return " > ".join(places) or "inside a library"


def _request(address: str, message: Dict[str, Any], timeout: float = REQUEST_TIMEOUT,
             answer: bool = True) -> Optional[Dict[str, Any]]:
    """Sends one JSON line to the watchdog at "host:port"; its one-line answer (None when
    `answer` is False). Raises OSError / ValueError when the peer cannot be reached or answers
    nonsense."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(json.dumps(message).encode() + b"\n")
        if not answer:
            return None
        data = _read_line(sock)
    return json.loads(data.decode())


def _read_line(sock: socket.socket) -> bytes:
    """The bytes up to and including the first newline, or what came before the peer closed."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


class Watchdog:
    """One rank's watchdog (module docstring). `listen()` before the ranks exchange addresses,
    `start()` after; `stop()` ends its threads (the side channel's socket closes)."""

    def __init__(self, timeout: float, poll: Optional[float] = None,
                 exit: Callable[[int], None] = os._exit) -> None:  # noqa: A002 - replaced in tests
        """Args:
          timeout: the bound, seconds > 0.
          poll: seconds between two looks at the progress table (default: a tenth of the
            bound, at most 1 s).
          exit: ends the process (tests replace it).
        """
        self.timeout = float(timeout)
        self.poll = float(poll) if poll is not None else min(1.0, self.timeout / 10)
        self._exit = exit
        self.rank = 0
        self.size = 1
        self.peers: List[Optional[str]] = []
        self.finals: Dict[int, Dict[str, Any]] = {}
        self._server: Optional[socket.socket] = None
        self._stopped = threading.Event()
        self._ending = threading.Lock()  # held while this rank reports and ends
        self._previous_hook: Optional[Callable] = None
        self._last_change = time.monotonic()  # when this rank's progress table last changed

    # -- the side channel ---------------------------------------------------------------
    def listen(self) -> str:
        """Opens the side channel; returns its "host:port" for the other ranks."""
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((listen_address(), 0))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, name="hvdx-watchdog-channel", daemon=True).start()
        host, port = server.getsockname()[:2]
        return f"{host}:{port}"

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stopped.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            try:
                threading.Thread(target=self._answer, args=(conn,), name="hvdx-watchdog-answer", daemon=True).start()
            except RuntimeError:  # the interpreter is shutting down: answer here
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(REQUEST_TIMEOUT)
                data = _read_line(conn)
                if not data.endswith(b"\n"):
                    return  # the peer closed before a whole request
                message = json.loads(data.decode())
                op = message.get("op")
                if op == "state":
                    conn.sendall(json.dumps(self.state()).encode() + b"\n")
                elif op == "final":
                    self.finals[int(message["state"]["rank"])] = message["state"]
                elif op == "abort":
                    self._aborted(int(message.get("rank", -1)), conn)
            except (OSError, ValueError, KeyError):
                return  # a peer that went away mid-request: nothing to answer

    def state(self, exited: bool = False) -> Dict[str, Any]:
        """This rank's state (`hvdx.stall`)."""
        counts = progress.snapshot()
        waiting = any(entered > left for entered, left in counts.values())
        return {"rank": self.rank, "counts": [[l, d, e, f] for (l, d), (e, f) in sorted(counts.items())],
                "where": _main_thread_place(), "exited": exited,
                "waited": (time.monotonic() - self._last_change) if waiting and not exited else None}

    def gather(self) -> Dict[int, Optional[Dict[str, Any]]]:
        """Every rank's state: this one's, the answers of the others (asked in parallel), else
        the state a rank left as it exited; None for a rank that neither answered nor left one."""
        states: Dict[int, Optional[Dict[str, Any]]] = {rank: None for rank in range(self.size)}
        states[self.rank] = self.state()

        def ask(rank: int, address: str) -> None:
            try:
                states[rank] = _request(address, {"op": "state"})
            except (OSError, ValueError):
                pass

        threads = [threading.Thread(target=ask, args=(rank, address), daemon=True)
                   for rank, address in enumerate(self.peers) if address and rank != self.rank]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_TIMEOUT + 1)
        for rank, final in list(self.finals.items()):
            if states.get(rank) is None:
                states[rank] = final
        return states

    def _tell_all(self, message: Dict[str, Any], parallel: bool = True) -> None:
        """Sends `message` to every other rank, waiting for none to answer: in parallel, or one
        after the other (at exit, where Python starts no threads)."""
        def send(address: str) -> None:
            try:
                _request(address, message, timeout=1.0, answer=False)
            except OSError:
                pass

        addresses = [address for rank, address in enumerate(self.peers) if address and rank != self.rank]
        if not parallel:
            deadline = time.monotonic() + 2.0  # an exit waits no longer for unreachable peers
            for address in addresses:
                if time.monotonic() > deadline:
                    return
                send(address)
            return
        threads = [threading.Thread(target=send, args=(address,), daemon=True) for address in addresses]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2.0)

    # -- the monitor --------------------------------------------------------------------
    def start(self, rank: int, size: int, peers: List[Optional[str]]) -> None:
        """Starts watching: `peers` holds every rank's side-channel address (by global rank)."""
        global _current
        self.rank, self.size, self.peers = rank, size, list(peers)
        self._last_change = time.monotonic()
        progress.enable(True)
        threading.Thread(target=self._monitor, name="hvdx-watchdog", daemon=True).start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._leave)
        _current = self

    def _monitor(self) -> None:
        seen = progress.generation()
        self._last_change = time.monotonic()
        while not self._stopped.wait(self.poll):
            now, generation = time.monotonic(), progress.generation()
            if generation != seen:
                seen, self._last_change = generation, now
            elif progress.open_calls() > 0 and now - self._last_change > self.timeout:
                self.end_stalled()
                return

    def end_stalled(self) -> None:
        """Reports the stall this rank found (every rank's state) on stderr, tells every rank
        to end, and ends this process with EXIT_CODE."""
        with self._ending:
            report = stall.stall_report(self.gather(), self.size, self.timeout, self.rank)
            sys.stderr.write(report)
            sys.stderr.flush()
            self._abort_all()
            self._exit(EXIT_CODE)

    def _abort_all(self) -> None:
        """Tells every other rank to end and waits (at most ABORT_WAIT seconds) until each has
        acknowledged, i.e. written why it ends; only then hangs up on all of them at once, the
        signal for them to exit. (A rank that exited first would close Horovod's connections,
        and Gloo aborts the ranks that had not yet written their line.)"""
        deadline = time.monotonic() + ABORT_WAIT
        sockets: List[socket.socket] = []
        lock = threading.Lock()

        def abort(address: str) -> None:
            try:
                host, port = address.rsplit(":", 1)
                sock = socket.create_connection((host, int(port)), timeout=1.0)
            except OSError:
                return
            with lock:
                sockets.append(sock)
            try:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                sock.sendall(json.dumps({"op": "abort", "rank": self.rank}).encode() + b"\n")
                _read_line(sock)  # the acknowledgement
            except OSError:
                pass

        threads = [threading.Thread(target=abort, args=(address,), daemon=True)
                   for rank, address in enumerate(self.peers) if address and rank != self.rank]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 0.1)
        with lock:
            for sock in sockets:
                sock.close()

    def _aborted(self, by: int, conn: Optional[socket.socket] = None) -> None:
        with self._ending:
            state = self.state()
            table = stall.calls({self.rank: state})
            waiting_in = [f"{label!r} on {detail!r} (call {table[label, detail][self.rank][0]})"
                          for label, detail in stall.inside(table, self.rank)]
            place = f"waiting in {', '.join(waiting_in)}" if waiting_in else "in no hvdx collective"
            sys.stderr.write(f"hvdx watchdog: rank {self.rank} ends because rank {by} found the job stalled; "
                             f"rank {self.rank} was {place}, at {state['where']} (rank {by}'s report says more)\n")
            sys.stderr.flush()
            if conn is not None:  # acknowledged; exit when the reporting rank hangs up
                try:
                    conn.sendall(b'{"ok": true}\n')
                    conn.settimeout(ABORT_WAIT + 1.0)
                    _read_line(conn)
                except OSError:
                    pass
            self._exit(EXIT_CODE)

    # -- errors and exits ---------------------------------------------------------------
    def _excepthook(self, kind, error, tb) -> None:
        (self._previous_hook or sys.__excepthook__)(kind, error, tb)
        text = f"{kind.__name__}: {error}"
        if not any(marker in text for marker in HOROVOD_MISMATCH_MARKERS):
            return
        self._tell_all({"op": "final", "state": self.state(exited=True)})
        time.sleep(0.5)  # the other ranks' own errors arrive at about the same time
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [kind.__name__]
        cause = lines[0]
        for line in lines:  # Horovod's own words, without TensorFlow's node prefix
            found = [line.index(m) for m in HOROVOD_MISMATCH_MARKERS if m in line]
            if found:
                cause = line[min(found):]
                break
        message = stall.mismatch_report(self.gather(), self.size, cause.split(". ")[0][:300])
        if message:
            sys.stderr.write(message)
            sys.stderr.flush()

    def _leave(self) -> None:
        """At exit: leaves this rank's final state with the others, so that a rank that waits
        in a call this one never makes can say so."""
        if not self._stopped.is_set():
            self._tell_all({"op": "final", "state": self.state(exited=True)}, parallel=False)
            self.stop()

    def stop(self) -> None:
        """Ends the threads and closes the side channel; marks stay as traced."""
        global _current
        self._stopped.set()
        if self._server is not None:
            try:
                self._server.close()
            except OSError:
                pass
        if _current is self:
            _current = None
            if sys.excepthook == self._excepthook:
                sys.excepthook = self._previous_hook or sys.__excepthook__
