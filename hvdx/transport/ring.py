"""Rings of ranks: a TCP ring among the members of each group, whose collectives progress on
a thread of their own while TensorFlow computes. DASO's global network (coquelin2021 sec. 3,
Figs. 1, 3 and 5) and AD-PSGD's final average (lian2018). Why not Horovod or mpi4py:
docs/transport.md.

    transport = GroupTransport.create(groups, rank)   # collective over all ranks
    request = transport.allreduce_sum(x)               # returns at once
    ...                                                # training goes on
    total = request.wait()                             # sum over the group, same bits on every member

A group is the ranks with the same local rank on every node (hvdx's cross sets). Each rank
holds one connection to its right neighbour in the group's ring and one from its left,
bootstrapped through one Horovod collective (`hvd.allgather_object` of every rank's
listening address); one progress thread executes the requests in submission order.

- `allreduce_sum(x)`: sum over the members, x float32 or float64; ring reduce-scatter then
  ring all-gather, streamed in chunks of `CHUNK_BYTES`. Each segment's final sum is
  computed by exactly one member and copied, so the result is bit-identical on every member.
- `allgather(x)`: every member's x in member order, any fixed-size dtype (bfloat16 and
  float16 included).

Contract: every member submits the same requests (operation, dtype, size) in the same
order; an input must not be modified until its request is done (it is read on the progress
thread, never copied on the caller's). Memory: an allreduce holds its result (1x the input)
and one chunk of receive buffer.

Raises `TransportError` from `Request.wait()`, naming the peer's global rank: when members
submit different requests (every frame carries the request's sequence number, operation,
dtype, size and chunk index, checked on receipt; the detecting rank forwards the reason
around the ring), or when a peer closes, dies or stalls for `timeout` seconds.
"""
from __future__ import annotations

import atexit
import hashlib
import queue
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hvdx.arguments import integer, is_integer, real
from hvdx.transport.base import Request, TransportError, _recv_exact, _tune, listen_address, send_failure, send_loop

__all__ = ["GroupTransport", "Request", "TransportError", "listen_address"]

CHUNK_BYTES = 1 << 20
"""Bytes per frame: the receive buffer of the reduce-scatter, and the pipelining grain."""

_MAGIC = 0x48565844  # "HVXD"
_HELLO = struct.Struct("!IIqqI")      # magic, protocol version, sender rank, sender index, body length
_PROTOCOL = 1
# One frame: magic, kind, op, request seq, elements, chunk index, payload bytes, dtype name.
_FRAME = struct.Struct("!IBBQQIQ16s")
_DATA, _ABORT = 1, 2
_OPS = {1: "allreduce_sum", 2: "allgather"}
_OP_CODE = {name: code for code, name in _OPS.items()}
_CONNECT_RETRY = 0.05   # seconds between connection attempts
_ABORT_GRACE = 1.0      # seconds a send failure waits for the reason to arrive from the left
_CONNECT_WINDOW = 30.0  # seconds of attempts at most (the peer listens before the address exchange)
_SUM_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _validate_groups(groups: Sequence[Sequence[int]], rank: int,
                     world: Optional[int]) -> Tuple[Tuple[int, ...], ...]:
    """The groups as tuples; ValueError naming the problem (overlap, rank not covered, ...)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise ValueError(f"groups must be a non-empty sequence of sequences of ranks, got {groups!r}")
    normalized = []
    seen: Dict[int, int] = {}
    for g, members in enumerate(groups):
        if isinstance(members, (str, bytes)) or not isinstance(members, Sequence) or not members:
            raise ValueError(f"groups[{g}] must be a non-empty sequence of ranks, got {members!r}")
        group = []
        for r in members:
            if not is_integer(r) or r < 0:
                raise ValueError(f"groups[{g}] holds {r!r}, not a rank (a non-negative int)")
            r = int(r)
            if r in seen:
                raise ValueError(f"groups are not disjoint: rank {r} is in groups[{seen[r]}] and groups[{g}]")
            seen[r] = g
            group.append(r)
        normalized.append(tuple(group))
    rank = integer(rank, "rank")
    if rank not in seen:
        raise ValueError(f"groups do not cover rank {rank}: {normalized}")
    if world is not None and sorted(seen) != list(range(world)):
        missing = sorted(set(range(world)) - set(seen))
        extra = sorted(set(seen) - set(range(world)))
        raise ValueError(f"groups must cover exactly the ranks 0..{world - 1} of the job"
                         + (f"; missing {missing}" if missing else "") + (f"; no such ranks {extra}" if extra else ""))
    return tuple(normalized)


def _pack_dtype(dtype: np.dtype) -> bytes:
    name = dtype.name.encode("ascii")
    if len(name) > 16:
        raise ValueError(f"dtype name {dtype.name!r} too long for the frame header")
    return name


class GroupTransport:
    """A ring over one group's members with a progress thread (see the module docstring).

    Build it with `GroupTransport.create()` (collective over all ranks). Requests run in
    submission order; the caller may submit while earlier ones run. An input array must not be
    modified until its request is done: the progress thread reads it during the exchange
    (no copy is taken on the caller's thread).
    """

    members: Tuple[int, ...]
    index: int

    def __init__(self, members: Tuple[int, ...], rank: int, timeout: float,
                 send_sock: Optional[socket.socket] = None, recv_sock: Optional[socket.socket] = None,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.members = members
        self.rank = rank
        self.index = members.index(rank)
        self.size = len(members)
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._send_sock = send_sock
        self._recv_sock = recv_sock
        self._seq = 0
        self._closed = False
        self._failure: Optional[TransportError] = None
        self._send_error: Optional[TransportError] = None
        self._lock = threading.Lock()
        self._requests: "queue.Queue[Optional[Tuple[Request, np.ndarray]]]" = queue.Queue()
        self._sends: "queue.Queue[Any]" = queue.Queue()
        self._progress: Optional[threading.Thread] = None
        self._sender: Optional[threading.Thread] = None
        if self.size > 1:
            self._progress = threading.Thread(target=self._progress_loop, name=f"hvdx-ring-progress-{rank}",
                                              daemon=True)
            self._sender = threading.Thread(target=self._send_loop, name=f"hvdx-ring-sender-{rank}", daemon=True)
            self._progress.start()
            self._sender.start()
        _live.add(self)

    # ------------------------------------------------------------------ set-up
    @classmethod
    def create(cls, groups: Sequence[Sequence[int]], rank: int, *, name: str = "hvdx.daso",
               timeout: float = 300.0) -> "GroupTransport":
        """Collective over ALL ranks (one `hvd.allgather_object` named `name`).

        Every rank opens a listening socket on `listen_address()`, the addresses are
        exchanged, and each rank connects into the ring of the group that contains it (to its
        right neighbour; it accepts its left one), after both check they agree on the group.
        `groups` lists every group, disjoint and covering all ranks (DASO passes the cross
        sets, `[tuple(node[l] for node in topo.node_ranks) for l in range(topo.local_size)]`);
        members are ordered as given. When every group has a single member nothing is
        exchanged and Horovod is not needed. `timeout` bounds the set-up and every later
        socket operation (seconds).
        """
        hvd = sys.modules.get("horovod.tensorflow")  # never initialized if never imported
        if hvd is not None and hvd.is_initialized():
            if is_integer(rank) and int(rank) != hvd.rank():
                raise ValueError(f"rank {rank} is not this process's Horovod rank {hvd.rank()}")
            return cls._create(groups, rank, name, timeout, world=hvd.size(),
                               allgather=lambda obj: hvd.allgather_object(obj, name=name))
        return cls._create(groups, rank, name, timeout, world=None, allgather=None)

    @classmethod
    def _create(cls, groups: Sequence[Sequence[int]], rank: int, name: str, timeout: float,
                world: Optional[int], allgather: Optional[Callable[[Any], List[Any]]]) -> "GroupTransport":
        """`create` with the address exchange given: `allgather(obj)` returns every rank's obj
        by rank (Horovod's allgather_object; tests pass an in-process one)."""
        timeout = real(timeout, "timeout", 0, low_open=True, expected="a positive number of seconds")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        all_groups = _validate_groups(groups, rank, world)
        rank = int(rank)
        members = next(g for g in all_groups if rank in g)
        if all(len(g) == 1 for g in all_groups):
            return cls(members, rank, float(timeout))  # nothing to connect, on any rank
        if allgather is None:
            raise RuntimeError("GroupTransport.create needs Horovod initialized (hvdx.init()) "
                               "when a group has more than one member")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((listen_address(), 0))
            listener.listen(8)
            host, port = listener.getsockname()[:2]
            entries = allgather((rank, host, port, all_groups))
            for r, entry in enumerate(entries):
                if entry[0] != r:
                    raise TransportError(f"address exchange {name!r}: entry {r} comes from rank {entry[0]}")
                if tuple(entry[3]) != all_groups:
                    raise ValueError(f"ranks disagree on the groups: rank {rank} passed {list(all_groups)}, "
                                     f"rank {r} passed {list(entry[3])}")
            if len(members) == 1:
                return cls(members, rank, float(timeout))
            addresses = {r: (entry[1], entry[2]) for r, entry in enumerate(entries)}
            send_sock, recv_sock = _connect_ring(listener, members, rank, addresses, float(timeout), name)
        finally:
            listener.close()
        return cls(members, rank, float(timeout), send_sock, recv_sock)

    @property
    def left(self) -> int:
        """Global rank this member receives from."""
        return self.members[(self.index - 1) % self.size]

    @property
    def right(self) -> int:
        """Global rank this member sends to."""
        return self.members[(self.index + 1) % self.size]

    # ---------------------------------------------------------------- requests
    def allreduce_sum(self, array: np.ndarray) -> Request:
        """Elementwise sum over the group's members, bit-identical on every member.

        `array`: float32 or float64 (any shape; the result has its shape). Ring reduce-scatter
        then all-gather: each segment's final sum is computed by one member in ring order, so
        it may differ in the last bit from another summation order, but never between members.
        Do not modify `array` until the request is done.
        """
        array = self._check_array(array, "array")
        if array.dtype not in _SUM_DTYPES:
            raise ValueError(f"array must be float32 or float64 for allreduce_sum, got {array.dtype}")
        return self._submit("allreduce_sum", array)

    def allgather(self, array: np.ndarray) -> Request:
        """Every member's array, as a list ordered like `members` (same shape and dtype on all).

        Any fixed-size dtype (ml_dtypes.bfloat16 and float16 included). The result's entries
        are views of one buffer; this member's entry is a copy of `array`. Do not modify
        `array` until the request is done.
        """
        array = self._check_array(array, "array")
        return self._submit("allgather", array)

    @staticmethod
    def _check_array(array: Any, argument: str) -> np.ndarray:
        if not isinstance(array, np.ndarray):
            raise ValueError(f"{argument} must be a numpy array, got {type(array).__name__}")
        if array.dtype.hasobject or array.dtype.itemsize == 0:
            raise ValueError(f"{argument} must have a fixed-size dtype, got {array.dtype}")
        return array

    def _submit(self, op: str, array: np.ndarray) -> Request:
        with self._lock:
            if self._closed:
                raise TransportError(f"rank {self.rank}: {op} on a closed transport")
            self._seq += 1
            request = Request(op, self._seq)
            if self.size == 1:
                request.began = request.started
                copy = array.copy()
                request._complete(copy if op == "allreduce_sum" else [copy])
                return request
            if self._failure is not None:
                request._complete(error=self._failure)
                return request
            self._requests.put((request, array))
        return request

    # ------------------------------------------------------------ progress thread
    def _progress_loop(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            request, array = item
            if self._failure is not None:
                request._complete(error=self._failure)
                continue
            request.began = time.perf_counter()
            try:
                result = self._execute(request, array)
            except BaseException as exc:  # noqa: B902 - any failure breaks the ring
                error = self._fail(self._as_transport_error(exc, request))
                request._complete(error=error)
            else:
                request._complete(result)

    def _as_transport_error(self, exc: BaseException, request: Request) -> TransportError:
        if self._failure is not None:
            return self._failure
        if isinstance(exc, TransportError):
            return exc
        if isinstance(exc, socket.timeout):
            return TransportError(f"rank {self.rank}: no data from rank {self.left} for {self.timeout} s during "
                                  f"{request.op} #{request.seq} (it, or a member before it in the ring "
                                  f"{list(self.members)}, is not taking part)")
        if isinstance(exc, OSError):
            return TransportError(f"rank {self.rank}: connection to rank {self.left} failed during {request.op} "
                                  f"#{request.seq}: {exc}")
        return TransportError(f"rank {self.rank}: {request.op} #{request.seq} failed: {exc!r}")

    def _execute(self, request: Request, array: np.ndarray) -> Any:
        flat = np.ascontiguousarray(array).reshape(-1)
        p, i, count = self.size, self.index, flat.size
        item = flat.dtype.itemsize
        dtype_name = _pack_dtype(flat.dtype)
        code = _OP_CODE[request.op]
        if request.op == "allreduce_sum":
            # Segment k = [bounds[k], bounds[k+1]) elements. Reduce-scatter step s: send segment
            # i-s, receive segment i-s-1 and add this member's part; after p-1 steps segment i+1
            # is final here. All-gather step s: send segment i+1-s, receive segment i-s.
            bounds = [k * count // p for k in range(p + 1)]  # as even as integers allow
            out = np.empty_like(flat)
            src_in, src_out = flat.view(np.uint8), out.view(np.uint8)
            scratch = np.empty(self.chunk_bytes, np.uint8)
            segments = [(bounds[k] * item, bounds[k + 1] * item) for k in range(p)]
            receives = [(i - s - 1) % p for s in range(p - 1)] + [(i - s) % p for s in range(p - 1)]
            first_send, source = i, src_in
        else:
            out = np.empty((p, count), flat.dtype)
            out[i] = flat
            src_out = out.reshape(-1).view(np.uint8)
            nbytes = count * item
            segments = [(k * nbytes, (k + 1) * nbytes) for k in range(p)]
            receives = [(i - s - 1) % p for s in range(p - 1)]
            first_send, source = i, src_out
        done_sending = threading.Event()
        step_count = len(receives)

        def chunks(segment: int) -> List[Tuple[int, int, int]]:
            lo, hi = segments[segment]
            if hi == lo:
                return [(0, lo, lo)]
            return [(c, start, min(start + self.chunk_bytes, hi))
                    for c, start in enumerate(range(lo, hi, self.chunk_bytes))]

        def header(step: int, chunk: int, nbytes: int) -> bytes:
            return _FRAME.pack(_MAGIC, _DATA, code, request.seq, count, step * 65536 + chunk, nbytes, dtype_name)

        # Chunk-grained pipeline: every received chunk is forwarded once processed, except in
        # the last step; the sender thread streams while this thread receives and reduces.
        for c, lo, hi in chunks(first_send):
            self._sends.put((header(0, c, hi - lo), source[lo:hi]))
        frame = bytearray(_FRAME.size)
        frame_view = memoryview(frame)
        peer = f"rank {self.left} (left neighbour of rank {self.rank})"
        for step, segment in enumerate(receives):
            reducing = request.op == "allreduce_sum" and step < p - 1
            for c, lo, hi in chunks(segment):
                _recv_exact(self._recv_sock, frame_view, peer)
                self._check_frame(frame, request, code, count, dtype_name, step, c, hi - lo)
                if reducing:
                    buf = scratch[:hi - lo]
                    _recv_exact(self._recv_sock, memoryview(buf), peer)
                    # out[seg] = own part + partial sum from the left (numpy releases the GIL)
                    lo_e, hi_e = lo // item, hi // item
                    np.add(flat[lo_e:hi_e], buf.view(flat.dtype), out=out[lo_e:hi_e])
                else:
                    _recv_exact(self._recv_sock, memoryview(src_out[lo:hi]), peer)
                if step < step_count - 1:
                    self._sends.put((header(step + 1, c, hi - lo), src_out[lo:hi]))
        self._sends.put(done_sending)
        # Sends are done once the right neighbour took every byte the kernel accepted; the
        # sender sets the event (or the transport fails and _failure says why).
        while not done_sending.wait(0.05):
            if self._failure is not None:
                raise self._failure
        if self._send_error is not None:  # wait for the failure it starts (or a better reason)
            deadline = time.monotonic() + _ABORT_GRACE + 1.0
            while self._failure is None and time.monotonic() < deadline:
                time.sleep(0.01)
            raise self._failure or self._send_error
        if self._failure is not None:
            raise self._failure
        if request.op == "allreduce_sum":
            return out.reshape(array.shape)
        return [out[k].reshape(array.shape) for k in range(p)]

    def _check_frame(self, frame: bytearray, request: Request, code: int, count: int, dtype_name: bytes,
                     step: int, chunk: int, nbytes: int) -> None:
        magic, kind, op, seq, their_count, position, their_bytes, their_dtype = _FRAME.unpack(frame)
        left = self.left
        if magic != _MAGIC:
            raise TransportError(f"rank {self.rank}: garbage from rank {left} (bad frame magic {magic:#x})")
        if kind == _ABORT:
            body = bytearray(their_bytes)
            _recv_exact(self._recv_sock, memoryview(body), f"rank {left}")
            reason = body.decode("utf-8", "replace")
            raise TransportError(reason)
        mine = f"{request.op} #{request.seq} of {count} x {dtype_name.decode()}"
        theirs = (f"{_OPS.get(op, f'op {op}')} #{seq} of {their_count} x "
                  f"{their_dtype.rstrip(bytes(1)).decode('ascii', 'replace')}")
        if (op, seq, their_count, their_dtype) != (code, request.seq, count, dtype_name.ljust(16, bytes(1))):
            raise TransportError(f"mismatched requests: rank {left} submitted {theirs}, "
                                 f"rank {self.rank} submitted {mine}")
        if (position, their_bytes) != (step * 65536 + chunk, nbytes):
            raise TransportError(f"rank {self.rank}: out-of-order frame from rank {left} in {mine}: got step "
                                 f"{position >> 16} chunk {position & 0xFFFF} of {their_bytes} bytes, expected "
                                 f"step {step} chunk {chunk} of {nbytes} bytes")

    # ---------------------------------------------------------------- sender thread
    def _send_loop(self) -> None:
        send_loop(self._sends, self._send, self._dropped, self._send_failed)

    def _dropped(self, item: Any) -> bool:
        # after a failure, data is dropped; only the abort notice goes out
        return (self._failure is not None or self._send_error is not None) and not isinstance(item, _Abort)

    def _send(self, item: Any) -> None:
        if isinstance(item, _Abort):
            self._send_sock.settimeout(min(self.timeout, 5.0))
            self._send_sock.sendall(item.frame)
            item.sent.set()
            return
        head, payload = item
        self._send_sock.sendall(head)
        self._send_sock.sendall(payload)

    def _send_failed(self, item: Any, exc: BaseException) -> None:
        if isinstance(item, _Abort):
            item.sent.set()
            return
        error = send_failure(self.rank, self.right, self.timeout, exc)
        # The right neighbour is gone or stuck. If it left because it found a problem
        # (a mismatch), that reason is on its way to us around the ring as an abort
        # notice from the left: give it a moment to win over this vaguer error.
        self._send_error = error
        timer = threading.Timer(_ABORT_GRACE, self._fail, (error,))
        timer.daemon = True
        timer.start()

    # ---------------------------------------------------------------- failure and close
    def _fail(self, error: TransportError) -> TransportError:
        """Breaks the transport: records the first error, tells the right neighbour why, and
        shuts the sockets so that every blocked call returns. Returns the recorded error."""
        with self._lock:
            if self._failure is not None:
                return self._failure
            self._failure = error
        if self._send_sock is not None and self._send_error is None:
            notice = _Abort(str(error))
            # The sender may be blocked in the middle of a frame: give it a moment to finish it
            # and send the notice; the sockets close regardless.
            self._sends.put(notice)
            notice.sent.wait(min(self.timeout, 2.0))
        self._shutdown_sockets()
        # Requests queued behind the failed one fail at once.
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._requests.put(None)
                break
            item[0]._complete(error=error)
        return error

    def _shutdown_sockets(self) -> None:
        for sock in (self._send_sock, self._recv_sock):
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def closed(self) -> bool:
        """Whether close() ran (the connections and threads are gone)."""
        return self._closed

    def close(self) -> None:
        """Closes the connections and stops the threads; idempotent, never hangs.

        Requests still in flight or queued fail with TransportError: wait for the ones you need
        first (on every member, or the peers' requests fail as well).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._failure is None:
                self._failure = TransportError(f"rank {self.rank}: transport closed")
        _live.discard(self)
        if self._progress is None:
            return
        self._requests.put(None)
        self._sends.put(None)
        self._shutdown_sockets()
        for thread in (self._progress, self._sender):
            thread.join(timeout=2.0)
        for sock in (self._send_sock, self._recv_sock):
            sock.close()
        while True:  # anything the progress thread did not reach
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0]._complete(error=self._failure)

    def __enter__(self) -> "GroupTransport":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<GroupTransport rank {self.rank} members {list(self.members)}{' closed' if self._closed else ''}>"


class _Abort:
    """The notice a failing member sends to its right neighbour, forwarded around the ring."""

    def __init__(self, reason: str) -> None:
        body = reason.encode("utf-8")[:65536]
        self.frame = _FRAME.pack(_MAGIC, _ABORT, 0, 0, 0, 0, len(body), b"") + body
        self.sent = threading.Event()


def _connect_ring(listener: socket.socket, members: Tuple[int, ...], rank: int,
                  addresses: Dict[int, Tuple[str, int]], timeout: float,
                  name: str) -> Tuple[socket.socket, socket.socket]:
    """Connects to the right neighbour and accepts the left one; both check the group."""
    p = len(members)
    index = members.index(rank)
    right, left = members[(index + 1) % p], members[(index - 1) % p]
    deadline = time.monotonic() + timeout
    body = repr((name, members)).encode()
    digest = hashlib.sha256(body).digest()

    # Right neighbour: it listens already (it opened its socket before the exchange), so a
    # refusal is retried only briefly (its backlog may be full) before failing clearly.
    send_sock = None
    connect_deadline = time.monotonic() + min(timeout, _CONNECT_WINDOW)
    while send_sock is None:
        try:
            send_sock = socket.create_connection(addresses[right], timeout=max(0.1, deadline - time.monotonic()))
        except OSError as exc:
            if time.monotonic() + _CONNECT_RETRY >= connect_deadline:
                raise TransportError(f"rank {rank} could not connect to rank {right} at "
                                     f"{addresses[right][0]}:{addresses[right][1]} within "
                                     f"{min(timeout, _CONNECT_WINDOW)} s: {exc}") from exc
            time.sleep(_CONNECT_RETRY)
    _tune(send_sock, timeout)
    send_sock.sendall(_HELLO.pack(_MAGIC, _PROTOCOL, rank, index, len(digest)) + digest)

    # Left neighbour: ignore anything that does not speak the protocol.
    recv_sock = None
    while recv_sock is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            send_sock.close()
            raise TransportError(f"rank {rank}: rank {left} did not connect within {timeout} s")
        listener.settimeout(remaining)
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        _tune(conn, timeout)
        try:
            head = bytearray(_HELLO.size)
            _recv_exact(conn, memoryview(head), "a connecting peer")
            magic, version, their_rank, their_index, length = _HELLO.unpack(head)
            if magic != _MAGIC or length != len(digest):
                raise TransportError("not an hvdx ring peer")
            theirs = bytearray(length)
            _recv_exact(conn, memoryview(theirs), f"rank {their_rank}")
        except (OSError, TransportError):
            conn.close()
            continue
        if version != _PROTOCOL or their_rank != left or bytes(theirs) != digest:
            conn.sendall(b"\x00")
            conn.close()
            send_sock.close()
            raise TransportError(f"rank {rank}: rank {their_rank} connected as its left neighbour (expected rank "
                                 f"{left}) or disagrees on group {list(members)} / transport {name!r}")
        conn.sendall(b"\x01")
        recv_sock = conn
    ack = bytearray(1)
    try:
        _recv_exact(send_sock, memoryview(ack), f"rank {right}")
    except (OSError, TransportError) as exc:
        ack[0] = 0
        error: Optional[Exception] = exc
    else:
        error = None
    if ack[0] != 1:
        send_sock.close()
        recv_sock.close()
        raise TransportError(f"rank {rank}: rank {right} refused the connection (it disagrees on group "
                             f"{list(members)} or transport {name!r}){f': {error}' if error else ''}")
    return send_sock, recv_sock


_live: "weakref.WeakSet[GroupTransport]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for transport in list(_live):
        transport.close()
