"""hvdx's own operations in Horovod's timeline (`HOROVOD_TIMELINE`), beside Horovod's.

Horovod's timeline (rank 0's view of its collectives: negotiation and each tensor's
reduction) shows none of hvdx's work: the strategies' calls and their steps (HiTopK's
node reduce-scatter, MSTopK with error feedback, the two all-gathers; 2DTAR's three steps),
DASO's global synchronisations, AD-PSGD's exchanges, DataCache's fills. While Horovod's
timeline is on, hvdx records these too and adds them to the same file when the job ends:

- in a graph, the marks of `hvdx.progress` (a call's `enter` / `leave`, and `span` marks
  'begin' / 'end' around each of its steps) record their wall-clock time in the op library
  (`hvdx_timeline_record`); from Python, `python_span` records a span directly;
- at `hvdx.shutdown()` or at exit, after Horovod's own timeline has closed, rank 0 appends
  its spans to Horovod's file (one timeline "process" per hvdx call, named
  "hvdx <strategy> '<buffer>'", below Horovod's tensors; times on Horovod's clock, from the
  start time its first record holds); every other rank writes its own spans, on the same
  clock, to `<file>.hvdx-rank<r>.json` (Horovod's file is rank 0's; `merge` puts them in it).

`HOROVOD_TIMELINE=DYNAMIC` (Horovod's timeline started later by `hvd.start_timeline(file)`)
is not followed: hvdx records only when $HOROVOD_TIMELINE names the file from the start.
`HVDX_TIMELINE=0` keeps hvdx's spans out (the marks are then not inserted for the timeline).
A span's begin is when its inputs exist and its end when its outputs do (what the marks can
see): in a graph, an op that waits for its inputs on another thread shows that wait as part
of the span before it.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import threading
import time
from collections import defaultdict, deque
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["ENV", "active", "events", "merge", "now_us", "python_span", "rank_file", "record", "span", "start", "stop",
           "write"]

#: hvdx's switch for its spans: "0" keeps them out of Horovod's timeline.
ENV = "HVDX_TIMELINE"
#: Horovod's value of $HOROVOD_TIMELINE for "no file yet: `hvd.start_timeline(file)` later".
DYNAMIC = "DYNAMIC"
#: The first process id of hvdx's spans in the timeline (Horovod numbers its tensors from 1).
PID_BASE = 100000
#: A span's name inside a call's detail ("<buffer>|<step>").
_SEP = "|"

_state: Dict[str, Any] = {"path": None, "rank": 0, "registered": False}
_python_events: List[Tuple[str, str, str, int, int]] = []
_python_lock = threading.Lock()


def _library():
    from hvdx import progress

    lib = progress._lib()
    lib.hvdx_timeline_record.argtypes = [ctypes.c_int]
    lib.hvdx_timeline_record.restype = ctypes.c_int
    lib.hvdx_timeline_drain.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    lib.hvdx_timeline_drain.restype = ctypes.c_int64
    lib.hvdx_timeline_dropped.restype = ctypes.c_int64
    return lib


def active() -> bool:
    """Whether hvdx records its spans (`start` was called with Horovod's timeline on)."""
    return _state["path"] is not None


def start(rank: int) -> bool:
    """Starts recording when Horovod's timeline is on ($HOROVOD_TIMELINE names a file, not
    Horovod's "DYNAMIC") and $HVDX_TIMELINE is not "0": turns the progress marks on (they
    carry the times) and the op library's recording. Called by `hvdx.init()`. Returns whether it records."""
    path = os.environ.get("HOROVOD_TIMELINE", "").strip()
    if not path or path == DYNAMIC or os.environ.get(ENV, "1").strip() == "0":
        return False
    from hvdx import progress

    _state["path"], _state["rank"] = path, int(rank)
    progress.enable(True)
    progress.record_spans(record)  # DASO's synchronisations, counted by progress.waiting
    _library().hvdx_timeline_record(1)
    if not _state["registered"]:
        atexit.register(_at_exit)
        _state["registered"] = True
    return True


def span(tensors: Sequence[Any], label: str, name: str, step: str, phase: str) -> List[Any]:
    """`tensors` through a timeline mark: `phase` "begin" (the step starts once they exist) or
    "end" (it ended once they do) of step `step` in the call (label, name); `tensors`
    unchanged while not recording. Use the returned tensors in place of `tensors`."""
    tensors = list(tensors)
    if not active() or not tensors:
        return tensors
    if phase not in ("begin", "end"):
        raise ValueError(f"a timeline span's phase is 'begin' or 'end', got {phase!r}")
    from hvdx import progress

    return progress.mark(tensors, label, f"{name}{_SEP}{step}", phase)


@contextlib.contextmanager
def python_span(label: str, name: str, step: str = "") -> Iterator[None]:
    """Records the body as one span (label, name, step) of the timeline (made from Python:
    DASO's and AD-PSGD's exchanges, DataCache's fills); nothing while not recording."""
    if not active():
        yield
        return
    begin = now_us()
    try:
        yield
    finally:
        record(label, name, step, begin, now_us())


def record(label: str, name: str, step: str, begin_us: int, end_us: int) -> None:
    """Records one span (label, name, step) that began and ended at the given microseconds
    since the epoch (`now_us`): for work whose start and end are seen on different threads
    (AD-PSGD's exchanges); nothing while not recording."""
    if not active():
        return
    detail = f"{name}{_SEP}{step}" if step else name
    thread = threading.get_ident() % 1000000
    with _python_lock:
        _python_events.append((label, detail, "begin", int(begin_us), thread))
        _python_events.append((label, detail, "end", int(end_us), thread))


def now_us() -> int:
    """Microseconds since the epoch (the timeline's clock)."""
    return time.time_ns() // 1000


def _drain() -> List[Tuple[str, str, str, int, int]]:
    lib, size = _library(), 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lib.hvdx_timeline_drain(buf, size)
        if n >= 0:
            break
        size = -n + (1 << 16)
    rows = []
    for line in buf.raw[:n].decode("utf-8", "replace").splitlines():
        label, detail, phase, micros, thread = line.split("\t")
        rows.append((label, detail, phase, int(micros), int(thread)))
    with _python_lock:
        rows.extend(_python_events)
        _python_events.clear()
    return sorted(rows, key=lambda row: row[3])


def events(rows: Sequence[Tuple[str, str, str, int, int]], origin: int, rank: int) -> List[Dict[str, Any]]:
    """Chrome-trace records of `rows` (label, detail, phase, microseconds since the epoch,
    thread), times relative to `origin` (microseconds since the epoch): a complete ('X')
    event per call (enter .. leave) and per step (begin .. end), paired in order per
    (label, detail); one process per call (label, buffer), named after it and the rank, with
    metadata records first. A begin or enter never closed is dropped."""
    opened: Dict[Tuple[str, str], deque] = defaultdict(deque)
    spans = []
    for label, detail, phase, micros, thread in rows:
        key = (label, detail)
        if phase in ("enter", "begin"):
            opened[key].append((micros, thread))
        elif opened[key]:
            begin, thread = opened[key].popleft()
            buffer, step = detail.rsplit(_SEP, 1) if phase == "end" and _SEP in detail else (detail, label)
            spans.append((label, buffer, step, begin, micros, thread))
    pids: Dict[Tuple[str, str], int] = {}
    meta, out = [], []
    for label, buffer, step, begin, end, thread in spans:
        key = (label, buffer)
        if key not in pids:
            pid = pids[key] = PID_BASE + 1000 * rank + len(pids)
            meta.append({"name": "process_name", "ph": "M", "pid": pid,
                         "args": {"name": f"hvdx {label} '{buffer}' (rank {rank})"}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        out.append({"ph": "X", "name": step, "cat": "hvdx", "ts": begin - origin, "dur": max(0, end - begin),
                    "pid": pids[key], "tid": thread, "args": {"rank": rank}})
    return meta + out


def _horovod_origin(text: str) -> Optional[int]:
    """The start time (microseconds since the epoch) that Horovod's timeline file records."""
    key = '"start_time_since_epoch_in_micros":'
    at = text.find(key)
    if at < 0:
        return None
    digits = text[at + len(key):].lstrip()
    end = next((i for i, ch in enumerate(digits) if not (ch.isdigit() or ch == "-")), len(digits))
    return int(digits[:end]) if end else None


def _append(path: str, records: List[Dict[str, Any]], origin_if_new: int) -> None:
    """Appends `records` to the chrome-trace JSON array in `path` (Horovod's file: it ends in
    ']'); a missing or empty file becomes an array with a start-time record first."""
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    body = text.rstrip().rstrip("]").rstrip().rstrip(",")
    if not body.strip().lstrip("["):
        body = "[\n" + json.dumps({"name": "process_name", "ph": "M", "pid": 0,
                                   "args": {"start_time_since_epoch_in_micros": origin_if_new}})
    lines = ",\n".join(json.dumps(record) for record in records)
    tmp = f"{path}.hvdx-tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(body + (",\n" + lines if lines else "") + "\n]\n")
    os.replace(tmp, path)


def rank_file(path: str, rank: int) -> str:
    """Where rank `rank` (not 0) writes its spans for Horovod's timeline file `path`."""
    return f"{path}.hvdx-rank{rank}.json"


def write() -> Optional[str]:
    """Adds the spans recorded so far to the timeline (module docstring) and returns the file
    written; None while not recording. Call after Horovod's timeline closed (`hvdx.shutdown()`
    and exit do); rows recorded later are written by a later call."""
    if not active():
        return None
    path, rank = _state["path"], _state["rank"]
    rows = _drain()
    target = path if rank == 0 else rank_file(path, rank)
    origin = _origin_of(target)
    if origin is None:
        origin = rows[0][3] if rows else now_us()
    _append(target, events(rows, origin, rank), origin)
    dropped = int(_library().hvdx_timeline_dropped())
    if dropped:
        import warnings

        warnings.warn(f"hvdx's timeline kept its first {1 << 22} events and dropped {dropped}", RuntimeWarning)
    return target


def _origin_of(path: str) -> Optional[int]:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return _horovod_origin(f.read())


def merge(path: str, ranks: Sequence[int]) -> None:
    """Moves the spans of `ranks` from their files (`rank_file`) into Horovod's timeline file
    `path` (on rank 0's clock: every file says when its clock started), removing those files.
    For a user on a shared file system, or after copying the files to one place."""
    with open(path, encoding="utf-8", errors="replace") as f:
        origin = _horovod_origin(f.read())
    if origin is None:
        raise ValueError(f"{path} is not a timeline with a start time (Horovod's or hvdx's)")
    for rank in ranks:
        other = rank_file(path, rank)
        with open(other, encoding="utf-8") as f:
            records = json.load(f)
        theirs = _horovod_origin(json.dumps(records[0])) if records else origin
        shift = (theirs or origin) - origin
        moved = [dict(record, ts=record["ts"] + shift) if "ts" in record else record
                 for record in records if record.get("pid", 0) >= PID_BASE]
        _append(path, moved, origin)
        os.remove(other)


def stop() -> None:
    """Stops recording (the spans kept so far stay for `write`)."""
    if active():
        _library().hvdx_timeline_record(0)


def _at_exit() -> None:
    """At exit: Horovod's shutdown first (its timeline file is complete and closed), then
    hvdx's spans are added."""
    if not active():
        return
    try:
        import horovod.tensorflow as hvd

        hvd.shutdown()
    except Exception:  # noqa: BLE001 - exiting: write what can be written
        pass
    try:
        write()
    except OSError as exc:
        import sys

        sys.stderr.write(f"hvdx: could not add its spans to the timeline {_state['path']}: {exc}\n")


def picture(path: str, out: str, match: str = "hitopk", calls: int = 1) -> str:
    """Draws `calls` of hvdx's calls whose process name contains `match` (rank 0's, from the
    second on: the first includes tracing) with Horovod's tensors of the same time in the
    timeline file `path`, as a PNG at `out` (matplotlib). Returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    names = {r["pid"]: r["args"].get("name", "") for r in records if r.get("name") == "process_name"}
    ours = [r for r in records if r.get("ph") == "X" and r.get("pid", 0) >= PID_BASE]
    top = sorted((r for r in ours if match in names.get(r["pid"], "") and r["name"] == match), key=lambda r: r["ts"])
    if not top:
        raise ValueError(f"no hvdx call matching {match!r} in {path}")
    chosen = top[1:1 + calls] or top[:calls]
    start, end = chosen[0]["ts"], max(r["ts"] + r["dur"] for r in chosen)
    margin = 0.05 * (end - start)
    start, end = start - margin, end + margin
    rows: Dict[str, List[Tuple[float, float, str]]] = defaultdict(list)
    for r in ours:
        if r["ts"] < end and r["ts"] + r["dur"] > start and r["args"].get("rank", 0) == 0:
            call = names[r["pid"]].split(" ")[1] == r["name"]  # "hvdx <strategy> '<buffer>' (rank r)"
            rows[names[r["pid"]] + ("" if call else ": steps")].append((r["ts"], r["dur"], r["name"]))
    stacks: Dict[int, List[Tuple[int, str]]] = defaultdict(list)
    for r in sorted((r for r in records if r.get("ph") in ("B", "E") and r.get("pid", 0) < PID_BASE),
                    key=lambda r: r["ts"]):
        if r["ph"] == "B":
            stacks[r["pid"]].append((r["ts"], r.get("name", "")))
        elif stacks[r["pid"]]:
            begin, what = stacks[r["pid"]].pop()
            if begin < end and r["ts"] > start:
                rows[f"Horovod: {names.get(r['pid'], r['pid'])}"].append((begin, r["ts"] - begin, what))
    labels = sorted(rows, key=lambda k: (not k.startswith("hvdx"), k))
    colours = plt.get_cmap("tab20")
    kinds = sorted({what for spans in rows.values() for _, _, what in spans})
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(labels) + 1.6))
    for y, label in enumerate(labels):
        for begin, dur, what in rows[label]:
            begin, finish = max(begin, start), min(begin + max(dur, 1), end)  # clipped to the window
            ax.broken_barh([((begin - start) / 1000, (finish - begin) / 1000)], (y - 0.4, 0.8),
                           facecolors=colours(kinds.index(what) % 20), edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"hvdx's '{match}' call and Horovod's collectives, rank 0 ({path.split('/')[-1]})", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(i % 20)) for i in range(len(kinds))]
    ax.legend(handles, kinds, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m hvdx.timeline merge FILE` (the other ranks' files beside it into it) or
    `python -m hvdx.timeline picture FILE OUT.png [--match hitopk]`."""
    import argparse
    import glob
    import re

    parser = argparse.ArgumentParser(prog="python -m hvdx.timeline", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    merging = sub.add_parser("merge", help="move the other ranks' spans into Horovod's timeline file")
    merging.add_argument("file")
    drawing = sub.add_parser("picture", help="draw one of hvdx's calls with Horovod's collectives (PNG)")
    drawing.add_argument("file")
    drawing.add_argument("out")
    drawing.add_argument("--match", default="hitopk", help="a strategy's name (default hitopk)")
    args = parser.parse_args(argv)
    if args.command == "merge":
        ranks = sorted(int(m.group(1)) for m in (re.search(r"\.hvdx-rank(\d+)\.json$", p)
                                                 for p in glob.glob(glob.escape(args.file) + ".hvdx-rank*.json")) if m)
        merge(args.file, ranks)
        print(f"merged the spans of ranks {ranks} into {args.file}")
    else:
        print(picture(args.file, args.out, args.match))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
