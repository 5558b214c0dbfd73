"""What hvdx's transports share: the error, the request handle, the address a rank listens
on, and socket helpers (blocking sockets bounded by kernel timeouts)."""
from __future__ import annotations

import os
import queue
import socket
import struct
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["Request", "TransportError", "listen_address"]


class TransportError(RuntimeError):
    """An exchange failed: a peer closed, died, stalled or submitted another request.

    The message names the peer's global rank and what failed.
    """


class Request:
    """One submitted exchange; completes on the transport's progress thread.

    `started` is the `time.perf_counter()` stamp of submission, `finished` the stamp of
    completion (None until then); `began` is when the progress thread took the request up
    (later than `started` when earlier requests were still running).
    """

    def __init__(self, op: str, seq: int) -> None:
        self.op = op
        self.seq = seq
        self.started: float = time.perf_counter()
        self.began: Optional[float] = None
        self.finished: Optional[float] = None
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: list = []
        self._callbacks_lock = threading.Lock()

    def done(self) -> bool:
        """Whether the request completed (successfully or not); never blocks."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The result; re-raises the progress thread's `TransportError`.

        Raises TimeoutError if the request is not done within `timeout` seconds (it keeps
        running; wait again later).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.op} request #{self.seq} not done within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def error(self) -> Optional[BaseException]:
        """The error the request failed with (None: pending or succeeded)."""
        return self._error if self._event.is_set() else None

    def add_done_callback(self, fn: Callable[["Request"], None]) -> None:
        """`fn(request)` runs once the request completes, on the thread that completes it (at
        once, on the caller's thread, if it already has). Keep it short: it runs on a
        transport thread."""
        with self._callbacks_lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _complete(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        with self._callbacks_lock:
            if self._event.is_set():
                return
            self._result, self._error = result, error
            self.finished = time.perf_counter()
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error is not None else "done")
        return f"<Request #{self.seq} {self.op} {state}>"


def listen_address() -> str:
    """The IPv4 address this rank listens on (never 0.0.0.0).

    The address of interface $HOROVOD_GLOO_IFACE (what horovodrun and hvdx's emulated
    cluster set), else of $HVDX_TRANSPORT_IFACE; else 127.0.0.1 when $HOROVOD_HOSTNAME names
    this machine (localhost, 127.0.0.1, its host name; horovodrun's emulated nodes on one
    machine) or is unset; else $HOROVOD_HOSTNAME resolved.
    """
    for var in ("HOROVOD_GLOO_IFACE", "HVDX_TRANSPORT_IFACE"):
        iface = os.environ.get(var)
        if not iface:
            continue
        import psutil

        addrs = psutil.net_if_addrs()
        if iface not in addrs:
            raise TransportError(f"${var}={iface!r} is not an interface of this machine "
                                 f"(interfaces: {', '.join(sorted(addrs))})")
        ipv4 = [a.address for a in addrs[iface] if a.family == socket.AF_INET]
        if not ipv4:
            raise TransportError(f"interface {iface!r} (${var}) has no IPv4 address")
        return ipv4[0]
    host = os.environ.get("HOROVOD_HOSTNAME", "")
    if host in ("", "localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()):
        return "127.0.0.1"
    return socket.gethostbyname(host)


def _recv_exact(sock: socket.socket, view: memoryview, peer: str) -> None:
    """Fills `view` from `sock`; TransportError if the peer closes first, TimeoutError if it
    sends nothing for the socket's timeout.

    The sockets are blocking with kernel timeouts (`_tune`), so MSG_WAITALL fills a whole
    chunk in one call: the progress thread takes the GIL once per chunk, not once per
    network packet, and a busy main thread cannot starve it.
    """
    got, size = 0, len(view)
    while got < size:
        try:
            n = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        except BlockingIOError as exc:  # SO_RCVTIMEO expired
            raise TimeoutError(f"{peer} sent nothing for the timeout") from exc
        if n == 0:
            raise TransportError(f"{peer} closed the connection ({got} of {size} bytes of a frame received)")
        got += n


def _tune(sock: socket.socket, timeout: float) -> None:
    """TCP_NODELAY, 4 MiB buffers, and blocking I/O bounded by kernel timeouts of `timeout` s."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass
    sock.settimeout(None)  # blocking: one recv/send call moves a whole chunk
    seconds = int(timeout)
    timeval = struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
    for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, opt, timeval)


def send_loop(items: "queue.Queue[Any]", send: Callable[[Any], None], dropped: Callable[[Any], bool],
              failed: Callable[[Any, BaseException], None]) -> None:
    """A transport's sender thread: sends queued items in order until None arrives.

    A `threading.Event` in the queue is set when every item before it was sent (a flush);
    `dropped(item)` items are skipped (e.g. data after a failure); `send(item)` writes one
    item; `failed(item, exc)` handles an exception `send` raised, and the loop goes on.
    """
    while True:
        item = items.get()
        if item is None:
            return
        if isinstance(item, threading.Event):
            item.set()
            continue
        if dropped(item):
            continue
        try:
            send(item)
        except BaseException as exc:  # noqa: B902 - reported through `failed`, the thread goes on
            failed(item, exc)


def send_failure(rank: int, peer: int, timeout: float, exc: BaseException) -> TransportError:
    """The error of a send to `peer` that raised `exc`: a kernel send timeout (the peer took
    no data for `timeout` s) or a broken connection (the peer exited or died)."""
    if isinstance(exc, (socket.timeout, BlockingIOError)):  # SO_SNDTIMEO expired
        return TransportError(f"rank {rank}: rank {peer} took no data for {timeout} s")
    return TransportError(f"rank {rank}: sending to rank {peer} failed ({exc}): rank {peer} exited or died")
