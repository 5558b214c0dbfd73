"""The progress marks of hvdx's collective calls, and this process's table of them.

A collective call (a strategy's aggregation of one buffer) is wrapped in two marks of the op
library (`HvdxProgressMark`, csrc/kernels/progress.h): `enter` runs once the call's inputs
exist, `leave` once its outputs do, each advancing the counter (label, detail) of the call,
e.g. ("hitopk", "grads"). A rank whose counter has entered > left waits in that call. The
marks forward their tensors (no copy) and cost two atomic additions per call; they are
inserted only while `enabled()` (the watchdog turns them on, `hvdx.watchdog`).

A collective call made from Python (a transport's exchange: DASO's global synchronisation)
is counted the same way by `waiting`, in a table of this module beside the library's.

`snapshot`, `generation` and `open_calls` read both tables (the library's through its C
functions), from any thread, while the step runs or waits (the watchdog's thread reads them,
never the step). They count from the last `rebase` (a new membership of the job: the ranks'
counts restart together, and a call abandoned by the old one is not waited in).
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf

from hvdx import ops

__all__ = ["Counts", "enable", "enabled", "generation", "mark", "open_calls", "rebase", "record_spans", "snapshot",
           "waiting"]

#: (label, detail) -> (calls entered, calls left).
Counts = Dict[Tuple[str, str], Tuple[int, int]]

_enabled = False
_token: Optional[tf.Variable] = None
_token_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
# the calls made from Python (`waiting`): counts, generation, calls entered and not left
_python_lock = threading.Lock()
_python_counts: Dict[Tuple[str, str], List[int]] = {}
_python_state = [0, 0]
# what the counters read at the last `rebase`: subtracted from every reading
_base_counts: Dict[Tuple[str, str], Tuple[int, int]] = {}
_base_open = 0
# who else hears of the calls `waiting` counts (`record_spans`)
_span_recorder: Optional[Callable[[str, str, str, int, int], None]] = None


def enable(on: bool = True) -> None:
    """Marks are inserted into collective calls traced from now on (on), or not (off);
    functions traced before keep what they have."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    """Whether `mark` inserts marks (`enable`)."""
    return _enabled


def _token_value() -> tf.Tensor:
    """An int32 scalar that is never a constant in a function (the read of a variable created
    once, eagerly), so that constant folding never runs a mark ahead of time. Outside a
    function, and in a function traced inside a TF1 graph (no eager context to keep the
    variable in: a variable made there dies with that graph), a constant."""
    global _token
    if not tf.inside_function():
        return tf.constant(0, tf.int32)
    with tf.init_scope():
        eager = tf.executing_eagerly()
    if not eager:
        return tf.constant(0, tf.int32)
    with _token_lock:
        if _token is None:
            with tf.init_scope():
                _token = tf.Variable(0, dtype=tf.int32, trainable=False, name="hvdx_progress_token")
    return _token.read_value()


def mark(tensors: Sequence[tf.Tensor], label: str, detail: str, phase: str) -> List[tf.Tensor]:
    """`tensors`, passed through a mark of `phase` ("enter" before the call's collectives,
    "leave" after them; "begin" / "end": a span of the timeline, counted nowhere,
    `hvdx.timeline.span`) on the counter (label, detail); `tensors` unchanged when marks are
    off (`enabled`) or there are none.

    Use the returned tensors in place of `tensors`: the mark runs because they are used.
    """
    tensors = list(tensors)
    if not _enabled or not tensors:
        return tensors
    return list(ops._ops.hvdx_progress_mark(inputs=tensors, token=_token_value(), label=label, detail=detail,
                                            phase=phase))


@contextlib.contextmanager
def waiting(label: str, detail: str) -> Iterator[None]:
    """Counts the body as one collective call (label, detail) made from Python: entered on
    entry, left on exit (an exception leaves it too: a failed call is not waited in).
    Counts nothing while marks are off (`enabled`)."""
    if not _enabled:
        yield
        return
    recorder = _span_recorder
    begin = time.time_ns() // 1000
    _python_record(label, detail, entered=True)
    try:
        yield
    finally:
        _python_record(label, detail, entered=False)
        if recorder is not None:
            recorder(label, detail, "", begin, time.time_ns() // 1000)


def record_spans(recorder: Optional[Callable[[str, str, str, int, int], None]]) -> None:
    """`waiting` also hands every call it counts to `recorder(label, detail, step, begin,
    end)` (microseconds since the epoch): the timeline's (`hvdx.timeline.start`); None: not."""
    global _span_recorder
    _span_recorder = recorder


def _python_record(label: str, detail: str, entered: bool) -> None:
    with _python_lock:
        counts = _python_counts.setdefault((label, detail), [0, 0])
        counts[0 if entered else 1] += 1
        _python_state[0] += 1
        _python_state[1] += 1 if entered else -1


@tf.RegisterGradient("HvdxProgressMark")
def _mark_grad(op: tf.Operation, *grads: tf.Tensor):
    return list(grads) + [None]


def _lib() -> ctypes.CDLL:
    """The op library's C functions (the same loaded library, hence the same table, as the ops')."""
    global _library
    if _library is None:
        lib = ctypes.CDLL(str(ops.library_path()))
        lib.hvdx_progress_snapshot.argtypes = [ctypes.c_char_p, ctypes.c_int64]
        lib.hvdx_progress_snapshot.restype = ctypes.c_int64
        lib.hvdx_progress_generation.restype = ctypes.c_int64
        lib.hvdx_progress_open.restype = ctypes.c_int64
        _library = lib
    return _library


def generation() -> int:
    """A number every mark (and `waiting`) advances: two equal readings mean none ran in between."""
    return int(_lib().hvdx_progress_generation()) + _python_state[0]


def open_calls() -> int:
    """Collective calls this process has entered and not left since the last `rebase` (0: it
    waits in none)."""
    return _open_since_start() - _base_open


def _open_since_start() -> int:
    return int(_lib().hvdx_progress_open()) + _python_state[1]


def rebase() -> None:
    """Counts restart from here: `snapshot` and `open_calls` read zero for every counter, and a
    call entered and never left (a step that failed under Elastic Horovod's reset, or in a job
    shut down in its middle) is no longer waited in. For a new membership of the job
    (hvdx.shutdown(), Elastic Horovod's reset), on every rank."""
    global _base_counts, _base_open
    _base_counts, _base_open = {}, 0
    _base_counts, _base_open = snapshot(), _open_since_start()


def snapshot() -> Counts:
    """Every counter of this process since the last `rebase`: (label, detail) -> (entered, left)."""
    lib, size = _lib(), 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lib.hvdx_progress_snapshot(buf, size)
        if n >= 0:
            break
        size = -n + 1024  # counters appeared meanwhile: a larger buffer
    counts: Counts = {}
    for line in buf.raw[:n].decode("utf-8", "replace").splitlines():
        label, detail, entered, left = line.split("\t")
        counts[label, detail] = (int(entered), int(left))
    with _python_lock:
        for key, (entered, left) in _python_counts.items():
            previous = counts.get(key, (0, 0))
            counts[key] = (previous[0] + entered, previous[1] + left)
    for key, (entered, left) in _base_counts.items():
        now = counts.get(key, (0, 0))
        counts[key] = (now[0] - entered, now[1] - left)
    return {key: value for key, value in counts.items() if value != (0, 0)}
