"""One node's model in a shared-memory segment (/dev/shm), without TensorFlow.

The shared-memory methods of hvdx.asynchronous keep a single copy of the flattened float32
model per node, read and updated concurrently by the node's processes: the "single copy of
the parameters shared by all threads" of Gimpel, Das, Smith, "Distributed Asynchronous Online
Learning for Natural Language Processing", CoNLL 2010 (Algorithm 1), and the shared-memory
model x of Kungurtsev, Egan, Chatterjee, Alistarh, "Asynchronous Optimization Methods for
Efficient Training of Deep Neural Networks with Guarantees", AAAI 2021, arXiv 1905.11845
(Algorithm 1). The layout is csrc/kernels/shared_model.h's; the kernels that read and update
the vector are in csrc/kernels/shared_model.cc (`hvdx.asynchronous.ops`).

Who removes the segment (no leak after a normal end, a killed rank or Ctrl-C):

1. The node's first rank `create`s it under a name holding its pid and a random token
   (O_CREAT | O_EXCL: never someone else's), writes the model, and starts a watchdog: a
   child process that holds the read end of a pipe and unlinks the name when the pipe
   closes, i.e. when the creator exits in any way, SIGKILL included.
2. The other ranks of the node `attach` (open + mmap, then count themselves in the header).
3. Once all have attached (`wait_attached`), the creator `unlink`s the name. From then on no
   name exists: the memory lives exactly as long as some process maps it, and the kernel
   frees it when the last one exits, however it exits. The watchdog then has nothing to do.

So a segment can outlive its job only if the creator and its watchdog are both killed
within the attach window; `sweep()` (run by every `create`) removes segments whose creator
pid no longer exists. Python's multiprocessing.shared_memory is not used: its resource
tracker unlinks segments it did not create and warns about "leaked" ones that another
process already removed.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

__all__ = ["SharedModel", "SharedModelError", "SHM_DIR", "PREFIX", "sweep", "segment_bytes"]

SHM_DIR = Path("/dev/shm")
PREFIX = "hvdx-async-"
MAGIC = b"HVDXSHM1"
LAYOUT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQQIIi12x")  # Header of csrc/kernels/shared_model.h
assert _HEADER.size == 64
# byte offsets of the header's atomic fields
_UPDATES, _ATTACHED, _READY = 32, 40, 44

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


class SharedModelError(RuntimeError):
    """A segment could not be created, attached or is not an hvdx shared model."""


def _align(x: int, to: int = 64) -> int:
    return (x + to - 1) // to * to


def _layout(block_sizes: Sequence[int]) -> tuple:
    """(block_begin offsets, records offset, data offset, total bytes)."""
    begins = np.concatenate([[0], np.cumsum(np.asarray(block_sizes, np.int64))]).astype(np.uint64)
    records = _align(_HEADER.size + 8 * len(begins))
    data = _align(records + 64 * len(block_sizes))
    return begins, records, data, data + 4 * int(begins[-1])


def segment_bytes(block_sizes: Sequence[int]) -> int:
    """Bytes of a segment holding blocks of these sizes (float32 elements)."""
    return _layout(block_sizes)[3]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(directory: Path = SHM_DIR) -> List[str]:
    """Removes hvdx segments whose creator process no longer exists (its pid is in the name:
    hvdx-async-<pid>-<token>). Returns the names removed."""
    removed = []
    for path in directory.glob(PREFIX + "*"):
        try:
            pid = int(path.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            try:
                path.unlink()
                removed.append(path.name)
            except FileNotFoundError:
                pass
    return removed


class SharedModel:
    """A mapped shared model segment: `params` (float32 view of the n elements), `address`
    (for the ops), the header's counters. Build with `create` or `attach`, never directly.

    Attributes:
      name: the segment's name in /dev/shm (it may already be unlinked).
      creator: whether this process created it (and owns the unlink).
      size: n, the number of float32 elements; block_begin: the blocks' element offsets.
    """

    def __init__(self, name: str, fd: int, creator: bool, directory: Path) -> None:
        self.name, self.creator, self.directory = name, creator, directory
        self.path = directory / name
        total = os.fstat(fd).st_size  # the caller closes fd
        if total < _HEADER.size:
            raise SharedModelError(f"{self.path} is {total} bytes: not an hvdx shared model segment")
        self._mmap = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._buffer = np.frombuffer(self._mmap, np.uint8)
        magic, version, blocks, size, data_offset, *_ = _HEADER.unpack_from(self._mmap, 0)
        if magic != MAGIC or version != LAYOUT_VERSION:
            self.close()
            raise SharedModelError(f"{self.path} is not an hvdx shared model segment of layout {LAYOUT_VERSION} "
                                   f"(magic {magic!r}, layout {version})")
        self.size, self.num_blocks = int(size), int(blocks)
        self.block_begin = np.frombuffer(self._mmap, np.uint64, blocks + 1, _HEADER.size).astype(np.int64)
        self.params = np.frombuffer(self._mmap, np.float32, self.size, data_offset)
        self._watchdog: Optional[subprocess.Popen] = None
        self._unlinked = False

    # -- lifecycle ---------------------------------------------------------------------
    @classmethod
    def create(cls, block_sizes: Sequence[int], initial: Optional[np.ndarray] = None, *,
               directory: Path = SHM_DIR, watchdog: bool = True) -> "SharedModel":
        """Creates a segment for blocks of these sizes (float32 elements, each > 0), writes
        `initial` (default zeros) and marks it ready. The caller owns the unlink (`unlink`, or
        `wait_attached` then `unlink`); the watchdog unlinks if this process dies first.

        Raises ValueError for empty or non-positive blocks or an `initial` of the wrong size,
        SharedModelError when /dev/shm cannot hold it."""
        sizes = [int(s) for s in block_sizes]
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"a shared model needs blocks of positive sizes, got {sizes}")
        begins, records, data, total = _layout(sizes)
        n = int(begins[-1])
        if initial is not None and np.size(initial) != n:
            raise ValueError(f"initial model has {np.size(initial)} elements, the blocks {n}")
        directory = Path(directory)
        sweep(directory)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        try:
            fd = os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise SharedModelError(f"cannot create the shared model segment {directory / name}: {exc}") from exc
        try:
            os.ftruncate(fd, total)
            # reserve the pages now: a full /dev/shm fails here, not with SIGBUS mid-training
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            os.close(fd)
            os.unlink(directory / name)
            raise SharedModelError(f"/dev/shm cannot hold a {total}-byte shared model ({exc}); free space there "
                                   f"or mount it larger (docker: --shm-size)") from exc
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        _HEADER.pack_into(mm, 0, b"\0" * 8, LAYOUT_VERSION, len(sizes), n, data, 0, 1, 0, 0)
        mm[_HEADER.size:_HEADER.size + 8 * len(begins)] = begins.astype("<u8").tobytes()
        if initial is not None:
            np.frombuffer(mm, np.float32, n, data)[:] = np.ravel(initial)
        mm[0:8] = MAGIC
        mm.close()
        try:
            model = cls(name, fd, True, directory)
        finally:
            os.close(fd)
        if watchdog:
            model._start_watchdog()
        model._store32(_READY, 1)
        return model

    @classmethod
    def attach(cls, name: str, *, directory: Path = SHM_DIR, timeout: float = 60.0) -> "SharedModel":
        """Maps the segment `name` created by another process, once it is ready, and counts
        this process in its header. Raises SharedModelError when it does not appear ready
        within `timeout` seconds (its creator failed or already unlinked it)."""
        directory = Path(directory)
        deadline = time.monotonic() + timeout
        while True:
            fd = -1
            try:
                fd = os.open(directory / name, os.O_RDWR)
                if os.fstat(fd).st_size >= _HEADER.size:
                    model = cls(name, fd, False, directory)
                    if model._load32(_READY) == 1:
                        # attachers count themselves under an flock of the file: attaching is
                        # rare, and the creator only reads the count
                        fcntl.flock(fd, fcntl.LOCK_EX)
                        try:
                            model._store32(_ATTACHED, model._load32(_ATTACHED) + 1)
                        finally:
                            fcntl.flock(fd, fcntl.LOCK_UN)
                        break
                    model.close()
            except (FileNotFoundError, SharedModelError):
                pass
            finally:
                if fd >= 0:
                    os.close(fd)
            if time.monotonic() > deadline:
                raise SharedModelError(f"shared model segment {directory / name} did not become ready within "
                                       f"{timeout} s: its creator (the node's first rank) failed or removed it "
                                       f"before this rank attached")
            time.sleep(0.01)
        return model

    def wait_attached(self, count: int, timeout: float = 60.0) -> None:
        """Waits until `count` processes (the creator included) have attached. Raises
        SharedModelError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.attached < count:
            if time.monotonic() > deadline:
                raise SharedModelError(f"{self.attached} of {count} processes attached to {self.path} within "
                                       f"{timeout} s")
            time.sleep(0.005)

    def unlink(self) -> None:
        """Removes the segment's name (creator only; idempotent). The memory stays mapped in
        every process that attached, and is freed when the last of them exits."""
        if not self.creator or self._unlinked:
            return
        self._unlinked = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._stop_watchdog()

    def close(self) -> None:
        """Unlinks (creator) and unmaps this process's view. Arrays taken from `params`
        before must not be used afterwards."""
        self.unlink()
        self.params = None  # type: ignore[assignment]
        self.block_begin = None  # type: ignore[assignment]
        self._buffer = None
        mm, self._mmap = self._mmap, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # an address is still exported to the ops: the OS unmaps at exit
                pass

    def __enter__(self) -> "SharedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what the ops need -------------------------------------------------------------
    @property
    def address(self) -> int:
        """The segment's address in this process, for hvdx.asynchronous.ops."""
        if self._buffer is None:
            raise SharedModelError(f"{self.name} is closed")
        return int(self._buffer.ctypes.data)

    @property
    def updates(self) -> int:
        """The model's version: updates applied so far."""
        return self._load64(_UPDATES)

    @property
    def attached(self) -> int:
        return self._load32(_ATTACHED)

    @property
    def unlinked(self) -> bool:
        return not self.path.exists()

    # -- header words (aligned: a NumPy read or write of one word is not torn) -----------------
    def _load32(self, offset: int) -> int:
        return int(np.frombuffer(self._mmap, np.uint32, 1, offset)[0])

    def _load64(self, offset: int) -> int:
        return int(np.frombuffer(self._mmap, np.uint64, 1, offset)[0])

    def _store32(self, offset: int, value: int) -> None:
        np.frombuffer(self._mmap, np.uint32, 1, offset)[0] = value

    def _start_watchdog(self) -> None:
        self._watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(self.path)], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)

    def _stop_watchdog(self) -> None:
        dog, self._watchdog = self._watchdog, None
        if dog is not None:
            dog.stdin.close()
            dog.wait(timeout=10)
