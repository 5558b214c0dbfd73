"""Shared-memory segments in /dev/shm: the one kit behind the node engine's segment
(`hvdx.node.shm_engine`, `node_engine="shm"`) and the asynchronous methods' shared model
(`hvdx.asynchronous.shared`). NumPy and the standard library only: no TensorFlow, no other
hvdx module (hvdx/asynchronous/shared.py loads this file by its path when it is itself
loaded without the hvdx package).

A segment is a file in /dev/shm that the processes of one node map. Every kind starts with
the same 32-byte header (`SegmentHeader` of csrc/kernels/shm_segment.h); the kind's own
fields follow it:

    offset  field            meaning
    0       magic[8]         the kind's magic, written last of the header by the creator
    8       layout_version   u32, the kind's layout
    12      creator_pid      i32, the process that created the segment
    16      attached         u32, processes that attached, the creator included
    20      ready            u32, 1 once the creator wrote the contents
    24      total_bytes      u64, the segment's size

The life of a segment (no name is left in /dev/shm after any exit, see each step):

1. `Segment._create` (the node's first process): O_CREAT | O_EXCL (never someone else's
   name), the size reserved now (posix_fallocate: a full /dev/shm fails here, not with
   SIGBUS later), the kind's fields and contents, the magic, then `ready`. Until it is
   unlinked the name is removed at the creator's exit (atexit) and, with `watchdog=True`,
   by a child process when the creator dies in any way, SIGKILL included.
2. `Segment._attach` (the others): open, map, check magic, layout and `ready` (retrying
   until a timeout when one is given), then count itself in `attached` under an flock of the
   file, after the kind's own checks under the same lock.
3. `wait_attached`, then `unlink`: once all mapped it the creator removes the name. The
   memory lives as long as some process maps it; the kernel frees it with the last one.
4. A creator killed (with its watchdog) before step 3 leaves a name: `sweep`, run by every
   `_create`, removes the names of its kind whose creator no longer exists.

Python's multiprocessing.shared_memory is not used: its resource tracker unlinks segments
it did not create and warns about "leaked" ones that another process already removed.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import mmap
import os
import secrets
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterator, List, Optional, Set, Tuple, Type, TypeVar

import numpy as np

__all__ = ["ALIGN", "HEADER", "HEADER_BYTES", "Kind", "PAGE", "SHM_DIR", "Segment", "align", "pid_alive", "sweep",
           "token"]

SHM_DIR = Path("/dev/shm")
#: Alignment of a segment's parts: a cache line (and the ops' check on an address).
ALIGN = 64
PAGE = 4096
#: The common header: magic, layout_version, creator_pid, attached, ready, total_bytes.
HEADER = struct.Struct("<8sIiIIQ")
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 32
# byte offsets of the header's words written after creation
_ATTACHED, _READY = 16, 20

_WATCHDOG = (
    "import os, sys\n"
    "path = sys.argv[1]\n"
    "while sys.stdin.buffer.read(4096):\n"
    "    pass\n"
    "try:\n"
    "    os.unlink(path)\n"
    "except FileNotFoundError:\n"
    "    pass\n"
)


def align(x: int, to: int = ALIGN) -> int:
    """x rounded up to a multiple of `to`."""
    return (x + to - 1) // to * to


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed process its parent has not
    reaped yet is gone for its segments and locks). False for pid <= 0. The same rule as
    `ProcessAlive` of csrc/kernels/shm_segment.h."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's: it exists
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc, or it just ended: trust kill()
        return True
    state = stat[stat.rfind(")") + 2:][:1]
    return state not in ("Z", "X")


def token() -> str:
    """The random part of a segment's name (12 hex digits)."""
    return secrets.token_hex(6)


@dataclass(frozen=True)
class Kind:
    """What sets one kind of segment apart.

    prefix: the names of its segments start with it ("hvdx-node-").
    magic: the 8 bytes at offset 0.
    version: the layout version; a process of another layout is refused.
    header_bytes: bytes of the common header and the kind's fields (a smaller file is not one).
    what: how messages name a segment ("node segment").
    creator: how messages name the process that creates one ("the node's local rank 0").
    error: the exception (a RuntimeError subclass) raised for the kind's segments.
    pid_in_name: names are <prefix><creator pid>-<...>, so that `sweep` knows the creator
      before its header is written.
    full_hint: appended to the message that /dev/shm cannot hold a segment.
    """

    prefix: str
    magic: bytes
    version: int
    header_bytes: int
    what: str
    creator: str
    error: Type[Exception]
    pid_in_name: bool = False
    full_hint: str = ""

    def name(self, *parts: object) -> str:
        """A segment name: the prefix, then `parts` joined by "-"."""
        return self.prefix + "-".join(str(part) for part in parts)

    def creator_pid(self, path: Path) -> Optional[int]:
        """The pid of the process that created the file `path`: from its name (`pid_in_name`)
        or its header; None when it is not known (not this kind's, or its header not yet
        written)."""
        if self.pid_in_name:
            try:
                return int(path.name[len(self.prefix):].split("-")[0])
            except ValueError:
                return None
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:8] != self.magic:
            return None
        return HEADER.unpack(head)[2]


def sweep(kind: Kind, directory: Path = SHM_DIR) -> List[str]:
    """Removes the segments of `kind` in `directory` whose creator no longer exists (only a
    creator killed before it unlinked leaves one); returns their names."""
    removed = []
    for path in Path(directory).glob(kind.prefix + "*"):
        try:
            pid = kind.creator_pid(path)
            if pid is not None and pid > 0 and not pid_alive(pid):
                path.unlink()
                removed.append(path.name)
        except (FileNotFoundError, PermissionError):
            continue
    return removed


#: Names this process created and has not unlinked yet (atexit removes them).
_CREATED: Set[Path] = set()


def _remove(path: Path) -> None:
    _CREATED.discard(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@atexit.register
def _unlink_created() -> None:
    for path in list(_CREATED):
        _remove(path)


@contextlib.contextmanager
def _flock(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


S = TypeVar("S", bound="Segment")


class Segment:
    """One mapped segment. A kind subclasses it, sets `kind`, reads its own fields in
    `_on_map`, and builds instances with `_create` and `_attach` (never directly).

    Attributes:
      path: the segment's file (it may already be unlinked); name, directory: its parts.
      creator: whether this process created it (and owns the unlink).
    """

    kind: ClassVar[Kind]

    def __init__(self, path: Path, mm: mmap.mmap, creator: bool) -> None:
        self.path, self.name, self.directory, self.creator = path, path.name, path.parent, creator
        self._mmap: Optional[mmap.mmap] = mm
        self._buffer: Optional[np.ndarray] = np.frombuffer(mm, np.uint8)
        self._unlinked = not creator
        self._watchdog: Optional[subprocess.Popen] = None
        self._on_map()

    def _on_map(self) -> None:
        """Reads the kind's fields once the segment is mapped and its header checked."""

    # -- create / attach ---------------------------------------------------------------
    @classmethod
    def _create(cls: Type[S], name: str, total: int, write: Callable[[mmap.mmap], None], *,
                directory: Path = SHM_DIR, watchdog: bool = False) -> S:
        """Creates the segment `name` of `total` bytes in `directory` (sweeping dead creators'
        segments of the kind first), writes the common header, calls `write(mm)` for the
        kind's fields and contents, then the magic; starts the watchdog if asked, then marks
        it ready. Raises kind.error when the name exists or /dev/shm cannot hold it."""
        kind = cls.kind
        path = Path(directory) / name
        sweep(kind, directory)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise kind.error(f"cannot create the {kind.what} {path}: {exc}") from exc
        _CREATED.add(path)
        try:
            try:
                os.ftruncate(fd, total)
                os.posix_fallocate(fd, 0, total)  # a full /dev/shm fails here, not with SIGBUS later
                mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise kind.error(f"/dev/shm cannot hold a {total}-byte {kind.what} ({exc}): free space there or mount "
                                 f"it larger (docker: --shm-size){kind.full_hint}") from exc
            finally:
                os.close(fd)
            HEADER.pack_into(mm, 0, b"\0" * 8, kind.version, os.getpid(), 1, 0, total)
            write(mm)
            mm[0:8] = kind.magic
            segment = cls(path, mm, True)
            if watchdog:
                segment._start_watchdog()
            segment._store32(_READY, 1)
        except BaseException:
            _remove(path)
            raise
        return segment

    @classmethod
    def _attach(cls: Type[S], name: str, *, directory: Path = SHM_DIR, timeout: Optional[float] = None,
                admit: Optional[Callable[[S], None]] = None) -> S:
        """Maps the segment `name` of `directory` created by another process and counts this
        process in its header; `admit(segment)` (the kind's checks, raising kind.error) runs
        first, under the same file lock.

        timeout None: one try, raising kind.error when the segment is missing, not of the
        kind or not ready; else tries until it is ready, raising kind.error after `timeout`
        seconds (its creator failed or removed it)."""
        kind = cls.kind
        path = Path(directory) / name
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                segment, fd = cls._open_ready(path)
                break
            except kind.error as problem:
                if deadline is None:
                    raise
                if time.monotonic() > deadline:
                    raise kind.error(f"{kind.what} {path} did not become ready within {timeout} s: {kind.creator} "
                                     f"failed or removed it before this rank attached") from problem
            time.sleep(0.01)
        try:
            with _flock(fd):  # attaching is rare: count under a file lock; the creator only reads the count
                if admit is not None:
                    admit(segment)
                segment._store32(_ATTACHED, segment.attached + 1)
        except BaseException:
            segment.close()
            raise
        finally:
            os.close(fd)
        return segment

    @classmethod
    def _open_ready(cls: Type[S], path: Path) -> Tuple[S, int]:
        """(the mapped segment, its open file) once its header is the kind's and ready."""
        kind = cls.kind
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise kind.error(f"cannot open the {kind.what} {path} ({exc}): {kind.creator} did not create it or "
                             f"removed it already") from exc
        try:
            total = os.fstat(fd).st_size
            if total < kind.header_bytes:
                raise kind.error(f"{path} is {total} bytes: not an hvdx {kind.what}")
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            magic, version, *_ = HEADER.unpack_from(mm, 0)
            if magic != kind.magic or version != kind.version:
                mm.close()
                raise kind.error(f"{path} is not an hvdx {kind.what} of layout {kind.version} (magic {magic!r}, "
                                 f"layout {version})")
            segment = cls(path, mm, False)
            if not segment.ready:
                segment.close()
                raise kind.error(f"{path} is not ready: {kind.creator} has not finished writing it")
        except BaseException:
            os.close(fd)
            raise
        return segment, fd

    def wait_attached(self, count: int, timeout: float = 60.0) -> None:
        """Waits until `count` processes (the creator included) have attached. Raises
        kind.error after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.attached < count:
            if time.monotonic() > deadline:
                raise self.kind.error(f"{self.attached} of {count} processes attached to {self.path} within "
                                      f"{timeout} s")
            time.sleep(0.005)

    # -- unlink / close ----------------------------------------------------------------
    def unlink(self) -> None:
        """Removes the segment's name (creator only; idempotent) and stops the watchdog. The
        memory stays mapped in every process that attached, and is freed when the last of
        them exits."""
        if not self.creator or self._unlinked:
            return
        self._unlinked = True
        _remove(self.path)
        self._stop_watchdog()

    def close(self) -> None:
        """Unlinks (creator) and unmaps this process's view. Arrays taken from the segment
        before must not be used afterwards."""
        self.unlink()
        self._buffer = None
        mm, self._mmap = self._mmap, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # an address is still exported (to the ops): the OS unmaps at exit
                pass

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the header --------------------------------------------------------------------
    @property
    def address(self) -> int:
        """The segment's address in this process (what the ops take)."""
        if self._buffer is None:
            raise self.kind.error(f"{self.name} is closed")
        return int(self._buffer.ctypes.data)

    @property
    def attached(self) -> int:
        """How many processes have attached (the creator included)."""
        return self._load32(_ATTACHED)

    @property
    def ready(self) -> bool:
        """Whether the creator has written the contents."""
        return self._load32(_READY) == 1

    @property
    def creator_pid(self) -> int:
        return int(HEADER.unpack_from(self._mmap, 0)[2])

    @property
    def unlinked(self) -> bool:
        """Whether the name is gone from its directory."""
        return not self.path.exists()

    # header words: aligned, so a NumPy read or write of one word is not torn
    def _load32(self, offset: int) -> int:
        return int(np.frombuffer(self._mmap, np.uint32, 1, offset)[0])

    def _load64(self, offset: int) -> int:
        return int(np.frombuffer(self._mmap, np.uint64, 1, offset)[0])

    def _store32(self, offset: int, value: int) -> None:
        np.frombuffer(self._mmap, np.uint32, 1, offset)[0] = value

    # -- the watchdog ------------------------------------------------------------------
    def _start_watchdog(self) -> None:
        """A child that holds the read end of a pipe and unlinks the name when it closes,
        i.e. when this process exits in any way."""
        self._watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(self.path)], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)

    def _stop_watchdog(self) -> None:
        dog, self._watchdog = self._watchdog, None
        if dog is not None:
            dog.stdin.close()
            dog.wait(timeout=10)
