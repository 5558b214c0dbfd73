"""One node's model in a shared-memory segment (/dev/shm), without TensorFlow.

The shared-memory methods of hvdx.asynchronous keep a single copy of the flattened float32
model per node, read and updated concurrently by the node's processes: the "single copy of
the parameters shared by all threads" of Gimpel, Das, Smith, "Distributed Asynchronous Online
Learning for Natural Language Processing", CoNLL 2010 (Algorithm 1), and the shared-memory
model x of Kungurtsev, Egan, Chatterjee, Alistarh, "Asynchronous Optimization Methods for
Efficient Training of Deep Neural Networks with Guarantees", AAAI 2021, arXiv 1905.11845
(Algorithm 1). The layout is csrc/kernels/shared_model.h's; the kernels that read and update
the vector are in csrc/kernels/shared_model.cc (`hvdx.ops.shared_read`, `shared_update`).
The segment's common header, creation, attachment, watchdog and sweep are `hvdx.shm`'s (the
kit the node engine's segment uses too); this module adds the model's fields and views.

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
pid no longer exists.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from hvdx import shm

__all__ = ["SharedModel", "SharedModelError", "SHM_DIR", "PREFIX", "sweep", "segment_bytes"]

SHM_DIR = shm.SHM_DIR
PREFIX = "hvdx-async-"
MAGIC = b"HVDXSHM1"
#: 2: the common header of hvdx.shm (csrc/kernels/shm_segment.h) at the start.
LAYOUT_VERSION = 2
#: Header of csrc/kernels/shared_model.h after the common header: num_blocks, whole_lock,
#: size, data_offset, updates.
_FIELDS = struct.Struct("<IiQQQ")
_HEADER_BYTES = shm.HEADER_BYTES + _FIELDS.size
assert _HEADER_BYTES == 64
_UPDATES = 56  # byte offset of the version counter (atomic)


class SharedModelError(RuntimeError):
    """A segment could not be created, attached or is not an hvdx shared model."""


MODEL = shm.Kind(prefix=PREFIX, magic=MAGIC, version=LAYOUT_VERSION, header_bytes=_HEADER_BYTES,
                 what="shared model segment", creator="its creator (the node's first rank)", error=SharedModelError,
                 pid_in_name=True)


def _layout(block_sizes: Sequence[int]) -> tuple:
    """(block_begin offsets, records offset, data offset, total bytes)."""
    begins = np.concatenate([[0], np.cumsum(np.asarray(block_sizes, np.int64))]).astype(np.uint64)
    records = shm.align(_HEADER_BYTES + 8 * len(begins))
    data = shm.align(records + 64 * len(block_sizes))
    return begins, records, data, data + 4 * int(begins[-1])


def segment_bytes(block_sizes: Sequence[int]) -> int:
    """Bytes of a segment holding blocks of these sizes (float32 elements)."""
    return _layout(block_sizes)[3]


def sweep(directory: Path = SHM_DIR) -> List[str]:
    """Removes hvdx segments whose creator process no longer exists (its pid is in the name:
    hvdx-async-<pid>-<token>). Returns the names removed."""
    return shm.sweep(MODEL, Path(directory))


class SharedModel(shm.Segment):
    """A mapped shared model segment: `params` (float32 view of the n elements), `address`
    (for the ops), the header's counters. Build with `create` or `attach`, never directly.

    Attributes:
      name: the segment's name in /dev/shm (it may already be unlinked).
      creator: whether this process created it (and owns the unlink).
      size: n, the number of float32 elements; block_begin: the blocks' element offsets.
    """

    kind = MODEL

    def _on_map(self) -> None:
        blocks, _, size, data_offset, _ = _FIELDS.unpack_from(self._mmap, shm.HEADER_BYTES)
        self.size, self.num_blocks = int(size), int(blocks)
        self.block_begin = np.frombuffer(self._mmap, np.uint64, blocks + 1, _HEADER_BYTES).astype(np.int64)
        self.params = np.frombuffer(self._mmap, np.float32, self.size, data_offset)

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

        def write(mm) -> None:
            _FIELDS.pack_into(mm, shm.HEADER_BYTES, len(sizes), 0, n, data, 0)
            mm[_HEADER_BYTES:_HEADER_BYTES + 8 * len(begins)] = begins.astype("<u8").tobytes()
            if initial is not None:
                np.frombuffer(mm, np.float32, n, data)[:] = np.ravel(initial)

        return cls._create(MODEL.name(os.getpid(), shm.token()), total, write, directory=Path(directory),
                           watchdog=watchdog)

    @classmethod
    def attach(cls, name: str, *, directory: Path = SHM_DIR, timeout: float = 60.0) -> "SharedModel":
        """Maps the segment `name` created by another process, once it is ready, and counts
        this process in its header. Raises SharedModelError when it does not appear ready
        within `timeout` seconds (its creator failed or already unlinked it)."""
        return cls._attach(name, directory=Path(directory), timeout=timeout)

    def close(self) -> None:
        """Unlinks (creator) and unmaps this process's view. Arrays taken from `params`
        before must not be used afterwards."""
        self.params = None  # type: ignore[assignment]
        self.block_begin = None  # type: ignore[assignment]
        super().close()

    @property
    def updates(self) -> int:
        """The model's version: updates applied so far."""
        return self._load64(_UPDATES)
