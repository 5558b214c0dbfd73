"""Point-to-point connections between chosen pairs of ranks, served by threads of their own:
what gossip needs (lian2018, "Asynchronous Decentralized Parallel Stochastic Gradient
Descent", Lian, Zhang, Zhang, Liu, ICML 2018, arXiv 1710.06952: sec. 3 and Appendix A).

    transport = PeerTransport.create(peers, rank)        # collective over all ranks
    transport.set_handler(answer)                        # answer(peer, theirs) -> mine
    request = transport.exchange(peer, mine, on_reply)   # returns at once
    ...                                                  # training goes on
    request.wait(timeout)                                # on_reply(theirs)'s result

Each rank holds one TCP connection to each of its peers (the lower rank connects, the higher
accepts), bootstrapped through one Horovod collective (`hvd.allgather_object` of every
rank's listening address and peer list, checked for symmetry). Two threads per rank: the
service thread reads every connection (`selectors`) and runs the handlers; the sender thread
writes every outgoing frame, so no caller blocks on the network.

- `exchange(peer, x, on_reply)`: "send my array, take yours": x goes to `peer`, whose
  handler answers with its own array (atomically, on its service thread); `on_reply(theirs)`
  runs on this rank's service thread and its return value is the request's result.
- `notify(peer, body)`: a small message for the peer's notice handler (in order with the
  exchanges on that connection: TCP keeps the order).
- `direct=True` (`exchange`, `notify`, `set_handler`): the frame is written on the calling
  thread (the answer on the service thread) instead of being handed to the sender thread: one
  hand-over of the GIL less per frame, which matters when the training loop holds the GIL
  (each hand-over then waits up to `sys.getswitchinterval()`). Frames to one peer never
  interleave (a lock per connection). Safe against two service threads blocking on each other's
  full buffers only if the two ends of a connection never both send large direct frames while
  the other is sending: AD-PSGD's roles guarantee it (one exchange in flight per active rank,
  the next request written only after the answer was read).
- `hold()` / `release()`: while held, incoming exchanges wait (answered in arrival order on
  release): the answering side's state can be replaced in between (AD-PSGD's average).

Failures are reported in bounded time and name the peer: a peer whose process ends closes
its sockets (the kernel does it when it dies), which its peers see at once; a peer that
stalls mid-frame or does not take data fails the transfer after `timeout` seconds; a peer
that does not answer an exchange fails `Request.wait(timeout)`. The rank that detects a
failure sends the reason to its other peers, which forward it once (`FAIL` frames), so every
rank of a connected graph learns it, with the failed rank's name, within a few network hops;
`failure` holds it, `on_failure` callbacks run, pending requests fail with it.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import queue
import selectors
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from hvdx.arguments import integer, is_integer, real
from hvdx.transport.base import Request, TransportError, _recv_exact, _tune, listen_address, send_failure, send_loop

__all__ = ["PeerTransport"]

_MAGIC = 0x48565850  # "HVXP"
_PROTOCOL = 2
_HELLO = struct.Struct("!IIq32s")   # magic, protocol, sender rank, digest of (name, edge)
# One frame: magic, kind, request seq, elements, dtype name, payload bytes, piggybacked bytes
# (after the payload; exchanges only).
_FRAME = struct.Struct("!IBQQ16sQI")
_REQUEST, _REPLY, _NOTICE, _FAIL, _BYE, _BEAT = 1, 2, 3, 4, 5, 6
_CONNECT_WINDOW = 30.0
_CONNECT_RETRY = 0.05

Handler = Callable[[int, np.ndarray], np.ndarray]


def _check_peers(peers: Sequence[int], rank: int, world: Optional[int]) -> Tuple[int, ...]:
    rank = integer(rank, "rank", 0, expected="a non-negative int")
    if isinstance(peers, (str, bytes)) or not isinstance(peers, Sequence):
        raise ValueError(f"peers must be a sequence of ranks, got {peers!r}")
    out = []
    for p in peers:
        if not is_integer(p) or p < 0:
            raise ValueError(f"peers holds {p!r}, not a rank (a non-negative int)")
        p = int(p)
        if p == rank:
            raise ValueError(f"rank {rank} lists itself as its peer")
        if world is not None and p >= world:
            raise ValueError(f"peer {p} is not a rank of this job of {world} ranks")
        out.append(p)
    if len(set(out)) != len(out):
        raise ValueError(f"peers lists a rank twice: {list(peers)}")
    return tuple(sorted(out))


class PeerTransport:
    """Connections to this rank's peers with a service and a sender thread (module docstring).

    Build it with `PeerTransport.create()` (collective over all ranks).
    """

    def __init__(self, rank: int, socks: Dict[int, socket.socket], timeout: float) -> None:
        self.rank = rank
        self.peers: Tuple[int, ...] = tuple(sorted(socks))
        self.timeout = timeout
        self._socks = socks
        self._lock = threading.Lock()
        self._seq = 0
        self._pending: Dict[int, Tuple[Request, int, Optional[Callable[[np.ndarray], Any]], np.dtype, int]] = {}
        self._handler: Optional[Handler] = None
        self._direct_replies = False
        self._piggyback_out: Optional[Callable[[int], bytes]] = None
        self._piggyback_in: Optional[Callable[[int, bytes], None]] = None
        self._send_locks: Dict[int, threading.Lock] = {p: threading.Lock() for p in socks}
        self._notice_handler: Optional[Callable[[int, bytes], None]] = None
        self._early_notices: List[Tuple[int, bytes]] = []
        self._failure_callbacks: List[Callable[[TransportError], None]] = []
        self.failure: Optional[TransportError] = None
        self._closed = False
        self._gone: Set[int] = set()           # peers that said goodbye
        now = time.monotonic()
        self._heard: Dict[int, float] = {p: now for p in socks}  # when a frame last came from each peer
        self._beaten = now                      # when heartbeats last went out
        self._held = False
        self._backlog: List[Tuple[int, int, np.ndarray]] = []
        self._hold_lock = threading.Lock()
        self.served = 0                         # exchanges answered
        self.initiated = 0                      # exchanges started
        self._sends: "queue.Queue[Any]" = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._service = threading.Thread(target=self._service_loop, name=f"hvdx-peer-service-{rank}", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name=f"hvdx-peer-sender-{rank}", daemon=True)
        self._service.start()
        self._sender.start()
        _live.add(self)

    # ------------------------------------------------------------------ set-up
    @classmethod
    def create(cls, peers: Sequence[int], rank: int, *, name: str = "hvdx.peer",
               timeout: float = 60.0) -> "PeerTransport":
        """Collective over ALL ranks (one `hvd.allgather_object` named `name`).

        `peers`: the ranks this rank talks to; the relation must be symmetric (rank a lists b
        iff b lists a), else ValueError on every rank naming the pair. `timeout` bounds the
        set-up and every later socket operation (seconds).
        """
        hvd = sys.modules.get("horovod.tensorflow")
        if hvd is None or not hvd.is_initialized():
            raise RuntimeError("PeerTransport.create needs Horovod initialized (hvdx.init())")
        if integer(rank, "rank", 0, expected="a non-negative int") != hvd.rank():
            raise ValueError(f"rank {rank} is not this process's Horovod rank {hvd.rank()}")
        return cls._create(peers, rank, name, timeout, world=hvd.size(),
                           allgather=lambda obj: hvd.allgather_object(obj, name=name))

    @classmethod
    def _create(cls, peers: Sequence[int], rank: int, name: str, timeout: float, world: Optional[int],
                allgather: Callable[[Any], List[Any]]) -> "PeerTransport":
        """`create` with the address exchange given: `allgather(obj)` returns every rank's obj
        by rank (Horovod's allgather_object; tests pass an in-process or file-based one)."""
        timeout = real(timeout, "timeout", 0, low_open=True, expected="a positive number of seconds")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        mine = _check_peers(peers, rank, world)
        rank = int(rank)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((listen_address(), 0))
            listener.listen(max(8, len(mine)))
            host, port = listener.getsockname()[:2]
            entries = allgather((rank, host, port, mine))
            for r, entry in enumerate(entries):
                if entry[0] != r:
                    raise TransportError(f"address exchange {name!r}: entry {r} comes from rank {entry[0]}")
            for p in mine:
                if p >= len(entries) or rank not in entries[p][3]:
                    raise ValueError(f"peers are not symmetric: rank {rank} lists rank {p} as its peer, "
                                     f"rank {p} does not (it lists {list(entries[p][3]) if p < len(entries) else []})")
            socks = _connect(listener, mine, rank, {r: (e[1], e[2]) for r, e in enumerate(entries)},
                             float(timeout), name)
        finally:
            listener.close()
        return cls(rank, socks, float(timeout))

    # ------------------------------------------------------------------ API
    def set_handler(self, handler: Handler, *, direct: bool = False) -> None:
        """`handler(peer, theirs) -> mine` answers a peer's exchange on the service thread;
        `mine` must have the shape and dtype of `theirs`. Exchanges that arrive before the
        handler is set wait for it. `direct`: the service thread writes the answer itself
        (module docstring)."""
        with self._hold_lock:
            self._handler = handler
            self._direct_replies = bool(direct)
            held = self._held
        if not held:
            self.release()

    def set_notice_handler(self, handler: Callable[[int, bytes], None]) -> None:
        """`handler(peer, body)` runs on the service thread for each `notify` from a peer;
        notices that arrived before it was set are handed to it first, in order."""
        with self._hold_lock:
            self._notice_handler = handler
            early, self._early_notices = self._early_notices, []
            for peer, body in early:
                handler(peer, body)

    def set_piggyback(self, outgoing: Callable[[int], bytes], incoming: Callable[[int, bytes], None]) -> None:
        """Small data carried on every exchange frame (request and answer), in the same write:
        `outgoing(peer) -> bytes` runs when a frame for `peer` is built (on the thread that
        builds it), `incoming(peer, data)` on the service thread when one arrives, before the
        handler or `on_reply` sees the array. AD-PSGD spreads its step counts this way."""
        self._piggyback_out, self._piggyback_in = outgoing, incoming

    def on_failure(self, callback: Callable[[TransportError], None]) -> None:
        """`callback(error)` runs once when the transport fails (at once if it already has)."""
        with self._lock:
            if self.failure is None:
                self._failure_callbacks.append(callback)
                return
        callback(self.failure)

    def exchange(self, peer: int, array: np.ndarray,
                 on_reply: Optional[Callable[[np.ndarray], Any]] = None, *, direct: bool = False) -> Request:
        """Sends `array` to `peer`, whose handler answers with its own; returns at once
        (`direct`: once the frame is written, on this thread; module docstring).

        The request's result is `on_reply(theirs)` (run on the service thread), or `theirs`.
        Do not modify `array` until the request is done. Raises ValueError for a peer that
        is not one of `peers` or an array that is not a 1-D numeric numpy array.
        """
        if peer not in self._socks:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank} (peers: {list(self.peers)})")
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in "fiu":
            raise ValueError(f"array must be a 1-D numeric numpy array, got {type(array).__name__} "
                             f"{getattr(array, 'dtype', '')} {getattr(array, 'shape', '')}")
        with self._lock:
            self._seq += 1
            request = Request(f"exchange with rank {peer}", self._seq)
            if self.failure is not None:
                request._complete(error=self.failure)
                return request
            if self._closed or peer in self._gone:
                request._complete(error=TransportError(f"rank {self.rank}: rank {peer} has left (it closed its "
                                                       f"transport) or this transport is closed"))
                return request
            self._pending[request.seq] = (request, peer, on_reply, array.dtype, array.size)
            self.initiated += 1
        extra = self._piggyback_out(peer) if self._piggyback_out is not None else b""
        self._put((peer, _header(_REQUEST, request.seq, array, len(extra)), array, extra), direct)
        return request

    def notify(self, peer: int, body: bytes, *, direct: bool = False) -> None:
        """Queues `body` for `peer`'s notice handler (after everything queued for it before;
        `direct`: written on this thread, after the frames written directly before it)."""
        if peer not in self._socks:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank} (peers: {list(self.peers)})")
        self._put((peer, _FRAME.pack(_MAGIC, _NOTICE, 0, 0, b"", len(body), 0), body), direct)

    def _put(self, item: Tuple[Any, ...], direct: bool) -> None:
        """Hands a frame to the sender thread, or (`direct`) writes it on this thread."""
        if not direct:
            self._sends.put(item)
            return
        if self._dropped(item):
            return
        try:
            self._send(item)
        except BaseException as exc:  # noqa: B902 - a broken connection breaks the transport
            self._send_failed(item, exc)

    def flush(self, timeout: Optional[float] = None) -> None:
        """Returns once every frame queued so far went to the kernel (TimeoutError otherwise)."""
        done = threading.Event()
        self._sends.put(done)
        if not done.wait(self.timeout if timeout is None else timeout):
            raise TimeoutError(f"rank {self.rank}: frames not sent within {timeout} s")

    def hold(self) -> None:
        """Incoming exchanges wait until `release()`."""
        with self._hold_lock:
            self._held = True

    def release(self) -> None:
        """Answers the exchanges that arrived while held, in order; later ones as they come."""
        with self._hold_lock:
            self._held = False
            if self._handler is None:
                return
            backlog, self._backlog = self._backlog, []
            for peer, seq, theirs in backlog:
                self._answer(peer, seq, theirs)

    def fail(self, error: TransportError) -> TransportError:
        """Breaks the transport with `error` (told to every peer); returns the recorded error."""
        return self._fail(error, None)

    def check(self) -> None:
        """Raises the recorded failure, if any."""
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------------ service thread
    def _service_loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        for peer, sock in self._socks.items():
            selector.register(sock, selectors.EVENT_READ, peer)
        header = bytearray(_FRAME.size)
        while not self._closed and self.failure is None:
            self._heartbeat()
            for key, _ in selector.select(min(0.5, self.timeout / 4)):
                peer = key.data
                if peer is None:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                    continue
                sock = self._socks[peer]
                try:
                    # readable: a frame (or the end of the connection) is there. Two reads per
                    # frame (header, then payload and piggyback), each a whole chunk: every read
                    # takes the GIL back, which costs up to a switch interval when the training
                    # loop holds it
                    _recv_exact(sock, memoryview(header), f"rank {peer}")
                    self._heard[peer] = time.monotonic()
                    self._frame(peer, sock, header)
                except BlockingIOError:
                    continue
                except BaseException as exc:  # noqa: B902 - a broken connection breaks the transport
                    selector.unregister(sock)
                    if peer in self._gone or self._closed:
                        continue
                    if isinstance(exc, TransportError) and str(exc) != "eof" and "closed the connection" not in str(exc):
                        self._fail(exc, None)
                    elif isinstance(exc, TimeoutError):
                        self._fail(TransportError(f"rank {self.rank}: rank {peer} stalled in the middle of a "
                                                  f"frame for {self.timeout} s"), None)
                    else:
                        self._fail(TransportError(f"rank {peer} closed its connection to rank {self.rank} "
                                                  f"without leaving (it exited or died)"), None)
                if self.failure is not None or self._closed:
                    break
        selector.close()

    def _frame(self, peer: int, sock: socket.socket, header: bytearray) -> None:
        magic, kind, seq, count, dtype_name, nbytes, extra = _FRAME.unpack(header)
        if magic != _MAGIC:
            raise TransportError(f"rank {self.rank}: garbage from rank {peer} (bad frame magic {magic:#x})")
        body = bytearray(nbytes + extra)
        if nbytes + extra:
            _recv_exact(sock, memoryview(body), f"rank {peer}")
        if kind == _REQUEST or kind == _REPLY:
            dtype = np.dtype(dtype_name.rstrip(b"\x00").decode("ascii"))
            if count * dtype.itemsize != nbytes:
                raise TransportError(f"rank {self.rank}: rank {peer} sent {nbytes} bytes for {count} x {dtype}")
            theirs = np.frombuffer(body, dtype, count)
            if extra and self._piggyback_in is not None:
                self._piggyback_in(peer, bytes(body[nbytes:]))
            if kind == _REQUEST:
                with self._hold_lock:
                    if self._held or self._handler is None:
                        self._backlog.append((peer, seq, theirs))
                    else:
                        self._answer(peer, seq, theirs)
            else:
                self._reply(peer, seq, theirs)
        elif kind == _NOTICE:
            with self._hold_lock:
                if self._notice_handler is None:
                    self._early_notices.append((peer, bytes(body)))
                else:
                    self._notice_handler(peer, bytes(body))
        elif kind == _FAIL:
            self._fail(TransportError(body.decode("utf-8", "replace")), peer)
        elif kind == _BEAT:
            pass  # its arrival (`_heard`) is the news
        elif kind == _BYE:
            with self._lock:
                self._gone.add(peer)
                orphans = [seq for seq, entry in self._pending.items() if entry[1] == peer]
            for s in orphans:
                entry = self._pending.pop(s, None)
                if entry is not None:
                    entry[0]._complete(error=TransportError(f"rank {peer} left before answering rank "
                                                            f"{self.rank}'s exchange"))
        else:
            raise TransportError(f"rank {self.rank}: unknown frame kind {kind} from rank {peer}")

    def _answer(self, peer: int, seq: int, theirs: np.ndarray) -> None:
        if self._handler is None:
            raise TransportError(f"rank {self.rank} has no handler for rank {peer}'s exchange")
        mine = np.ascontiguousarray(self._handler(peer, theirs))
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            raise TransportError(f"rank {self.rank}: its answer to rank {peer} has {mine.dtype}{mine.shape}, "
                                 f"rank {peer} sent {theirs.dtype}{theirs.shape}")
        self.served += 1
        extra = self._piggyback_out(peer) if self._piggyback_out is not None else b""
        self._put((peer, _header(_REPLY, seq, mine, len(extra)), mine, extra), self._direct_replies)

    def _reply(self, peer: int, seq: int, theirs: np.ndarray) -> None:
        with self._lock:
            entry = self._pending.pop(seq, None)
        if entry is None:
            raise TransportError(f"rank {self.rank}: rank {peer} answered exchange #{seq}, which is not pending")
        request, expected, on_reply, dtype, count = entry
        if expected != peer or theirs.dtype != dtype or theirs.size != count:
            request._complete(error=TransportError(
                f"rank {self.rank}: rank {peer} answered exchange #{seq} (sent to rank {expected}) with "
                f"{theirs.size} x {theirs.dtype}, expected {count} x {dtype}"))
            return
        try:
            result = on_reply(theirs) if on_reply is not None else theirs
        except BaseException as exc:  # noqa: B902 - the caller's error, on its request
            request._complete(error=exc)
        else:
            request._complete(result)

    def _heartbeat(self) -> None:
        """Service thread: a heartbeat to every peer each `timeout / 4` s, and a peer that sent
        nothing (no frame, no heartbeat) for `timeout` s reported: a rank that is alive but
        stuck (stopped, hung in native code without its threads, its network cut) is named in
        bounded time, also by ranks that wait for it without an exchange in flight."""
        now = time.monotonic()
        if now - self._beaten >= self.timeout / 4:
            self._beaten = now
            for peer in self.peers:
                if peer not in self._gone:
                    self._sends.put((peer, _FRAME.pack(_MAGIC, _BEAT, 0, 0, b"", 0, 0), b""))
        for peer, heard in self._heard.items():
            if peer not in self._gone and now - heard > self.timeout:
                try:  # frames waiting unread (this thread was busy with another peer's) are news too
                    self._socks[peer].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    continue  # data, or the end of the connection: the read reports it
                except BlockingIOError:
                    pass
                except OSError:
                    continue
                self._fail(TransportError(f"rank {peer} sent rank {self.rank} nothing for {self.timeout:g} s, not "
                                          f"even a heartbeat: it is stuck (stopped, hung) or its network is"), None)
                return

    # ------------------------------------------------------------------ sender thread
    def _send_loop(self) -> None:
        send_loop(self._sends, self._send, self._dropped, self._send_failed)

    def _dropped(self, item: Tuple[Any, ...]) -> bool:
        peer, head = item[0], item[1]
        return peer in self._gone or (self.failure is not None and head[4] != _FAIL)

    def _send(self, item: Tuple[Any, ...]) -> None:
        peer, parts = item[0], [memoryview(part).cast("B") for part in item[1:] if len(part)]
        sock = self._socks[peer]
        with self._send_locks[peer]:  # a frame is written whole (the sender thread or a direct writer)
            while parts:  # one system call (one return of the GIL) for the whole frame, as a rule
                sent = sock.sendmsg(parts)
                while parts and sent >= len(parts[0]):
                    sent -= len(parts[0])
                    parts.pop(0)
                if parts and sent:
                    parts[0] = parts[0][sent:]

    def _send_failed(self, item: Tuple[Any, ...], exc: BaseException) -> None:
        peer, head = item[0], item[1]
        if head[4] in (_FAIL, _BYE) or peer in self._gone or self._closed:
            return
        error = send_failure(self.rank, peer, self.timeout, exc)
        threading.Thread(target=self._fail, args=(error, None), daemon=True).start()

    # ------------------------------------------------------------------ failure and close
    def _fail(self, error: TransportError, source: Optional[int]) -> TransportError:
        with self._lock:
            if self.failure is not None:
                return self.failure
            self.failure = error
            pending, self._pending = list(self._pending.values()), {}
            callbacks, self._failure_callbacks = self._failure_callbacks, []
        body = str(error).encode("utf-8")[:65536]
        done = threading.Event()
        for peer in self.peers:
            if peer != source and peer not in self._gone:
                self._sends.put((peer, _FRAME.pack(_MAGIC, _FAIL, 0, 0, b"", len(body), 0), body))
        self._sends.put(done)
        for entry in pending:
            entry[0]._complete(error=error)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - a callback's bug must not hide the failure
                pass
        if threading.current_thread() is not self._sender:
            done.wait(min(self.timeout, 2.0))
        self._wake()
        return error

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\x00")
        except OSError:
            pass

    def close(self) -> None:
        """Says goodbye to every peer and stops the threads; idempotent, never hangs.

        Exchanges still pending fail with TransportError. Peers that exchange with this rank
        afterwards get TransportError saying it has left.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = list(self._pending.values()), {}
        _live.discard(self)
        error = self.failure or TransportError(f"rank {self.rank}: transport closed")
        for entry in pending:
            entry[0]._complete(error=error)
        done = threading.Event()
        if self.failure is None:
            for peer in self.peers:
                self._sends.put((peer, _FRAME.pack(_MAGIC, _BYE, 0, 0, b"", 0, 0), b""))
        self._sends.put(done)
        done.wait(min(self.timeout, 2.0))
        self._sends.put(None)
        self._wake()
        for sock in self._socks.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in (self._service, self._sender):
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)
        for sock in list(self._socks.values()) + [self._wake_r, self._wake_w]:
            sock.close()

    def __enter__(self) -> "PeerTransport":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<PeerTransport rank {self.rank} peers {list(self.peers)}{' closed' if self._closed else ''}>"


def _header(kind: int, seq: int, array: np.ndarray, extra: int = 0) -> bytes:
    name = array.dtype.name.encode("ascii")
    return _FRAME.pack(_MAGIC, kind, seq, array.size, name, array.nbytes, extra)


def _connect(listener: socket.socket, peers: Tuple[int, ...], rank: int,
             addresses: Dict[int, Tuple[str, int]], timeout: float, name: str) -> Dict[int, socket.socket]:
    """Connects to the higher peers, accepts the lower ones; both sides check the edge."""
    deadline = time.monotonic() + timeout
    socks: Dict[int, socket.socket] = {}

    def digest(a: int, b: int) -> bytes:
        return hashlib.sha256(repr((name, min(a, b), max(a, b))).encode()).digest()

    try:
        for peer in (p for p in peers if p > rank):
            connect_deadline = time.monotonic() + min(timeout, _CONNECT_WINDOW)
            while True:
                try:
                    sock = socket.create_connection(addresses[peer], timeout=max(0.1, deadline - time.monotonic()))
                    break
                except OSError as exc:
                    if time.monotonic() + _CONNECT_RETRY >= connect_deadline:
                        raise TransportError(f"rank {rank} could not connect to rank {peer} at "
                                             f"{addresses[peer][0]}:{addresses[peer][1]}: {exc}") from exc
                    time.sleep(_CONNECT_RETRY)
            _tune(sock, timeout)
            sock.sendall(_HELLO.pack(_MAGIC, _PROTOCOL, rank, digest(rank, peer)))
            socks[peer] = sock
        lower = {p for p in peers if p < rank}
        while lower:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(f"rank {rank}: rank(s) {sorted(lower)} did not connect within {timeout} s")
            listener.settimeout(remaining)
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            _tune(conn, timeout)
            head = bytearray(_HELLO.size)
            try:
                _recv_exact(conn, memoryview(head), "a connecting peer")
            except (OSError, TransportError):
                conn.close()
                continue
            magic, version, their, their_digest = _HELLO.unpack(head)
            if magic != _MAGIC or version != _PROTOCOL or their not in lower or their_digest != digest(rank, their):
                conn.sendall(b"\x00")
                conn.close()
                raise TransportError(f"rank {rank}: rank {their} connected but is not an expected peer "
                                     f"{sorted(lower)} of transport {name!r}, or disagrees on it")
            conn.sendall(b"\x01")
            socks[their] = conn
            lower.discard(their)
        for peer in (p for p in peers if p > rank):
            ack = bytearray(1)
            _recv_exact(socks[peer], memoryview(ack), f"rank {peer}")
            if ack[0] != 1:
                raise TransportError(f"rank {rank}: rank {peer} refused the connection (transport {name!r})")
    except BaseException:
        for sock in socks.values():
            sock.close()
        raise
    return socks


_live: "weakref.WeakSet[PeerTransport]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for transport in list(_live):
        transport.close()


def encode_notice(**fields: Any) -> bytes:
    """A notice body from JSON-serialisable fields (what AD-PSGD sends)."""
    return json.dumps(fields, sort_keys=True).encode("utf-8")
