"""Epoch 1's filling of the node store (shi2021 sec. 4.1), ahead of the reader: a clairvoyant
prefetcher (beyond the paper). The order of every epoch is known from the seed, so the
samples of the rank's share that the store lacks are read and decoded in the order the
reader will want them, at most `lookahead` ahead of it; the reader takes them (`take`,
`complete`) and puts each batch into the store in one transaction. The epoch's leftovers
(remainder="drop") are put into the store by the prefetcher itself; after the epoch's last
batch the reader waits for them (`finish_leftovers`), so their decode errors surface in
the epoch that decodes them.

Every sample the prefetcher will prepare has a future from the start: the reader waits on
it and never decodes a sample twice; what the prefetcher has not reached when it stops (a
new epoch began, the reader is gone) is handed to a thread pool or cancelled.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvdx.data.decode import Resolution
from hvdx.data.loader import BLOCK, Loader
from hvdx.data.store import NodeStore, Sample, sample_key

__all__ = ["Prefetcher"]

Missing = List[Tuple[int, bool]]
"""Samples the store lacks, in reading order: (sample id, whether it is a leftover)."""


class Prefetcher:
    """Fills `store` with the samples `loader` reads and decodes, ahead of the reader.

    `io_threads`: Python threads reading (and decoding) at once; `lookahead`: how many
    decoded samples the prefetcher may hold that the reader has not taken."""

    def __init__(self, store: NodeStore, loader: Loader, io_threads: int, lookahead: int) -> None:
        self.store, self.loader, self.lookahead = store, loader, lookahead
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hvdx-datacache")
        self._read_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hvdx-datacache-read")
        self._lock = threading.Lock()
        self._inflight: Dict[Tuple[int, object], Tuple[Future, Callable[[], None]]] = {}
        self._taken: set = set()  # samples the reader has asked for (the prefetcher skips them)
        self._leftovers: Dict[Tuple[int, object], Future] = {}  # leftovers being put by the prefetcher
        self._stop: Optional[threading.Event] = None
        self._drain: Optional[threading.Event] = None  # set: the reader has its share, no gate
        self._thread: Optional[threading.Thread] = None

    # -- the feeder ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stops the running feeder (a new epoch begins) and forgets what the reader took."""
        if self._stop is not None:
            self._stop.set()
        with self._lock:
            self._taken.clear()

    def start(self, missing: Missing, resolution: Resolution) -> None:
        """Starts a feeder thread preparing `missing` at `resolution` (call `stop` first)."""
        stop, drain = threading.Event(), threading.Event()
        self._stop, self._drain = stop, drain
        feed = self._feed if resolution is not None else self._feed_threads
        self._thread = threading.Thread(target=feed, args=(missing, resolution, stop, drain), daemon=True,
                                        name="hvdx-datacache-feeder")
        self._thread.start()

    def _feed_threads(self, missing: Missing, resolution: Resolution, stop: threading.Event,
                      drain: threading.Event) -> None:
        """`_feed` for samples of no fixed resolution (they cannot be batched): every sample
        read and decoded by a Python worker (`io_threads` of them, at most one decode per core)."""
        slots = threading.Semaphore(self.lookahead)
        for sample, leftover in missing:
            while not drain.is_set() and not slots.acquire(timeout=0.1):  # a reader that stopped frees none
                if stop.is_set():
                    return
            key = (sample, resolution)
            with self._lock:
                if stop.is_set():
                    return
                if key in self._inflight or key in self._taken or key in self._leftovers:
                    continue
                if leftover:
                    future = self._pool.submit(self.decode_and_put, sample, resolution)
                    future.add_done_callback(lambda _: slots.release())
                    self._leftovers[key] = future
                    continue
                self._inflight[key] = (self._pool.submit(self.loader.decode, sample, resolution), slots.release)

    def _feed(self, missing: Missing, resolution: Tuple[int, int], stop: threading.Event,
              drain: threading.Event) -> None:
        """Reads and decodes `missing` in order, at most `lookahead` ahead of the reader.
        Leftovers are put into the store here; the others are handed to the reader.

        Reading and decoding run in `Loader.blocks`' tf.data pipeline (TensorFlow's threads,
        no Python per sample where the files are on a local disk, the same decode graph as a
        plain tf.data pipeline). A sample whose read or decode fails goes through
        `Loader.decode` (its file named, or skipped) and the pipeline resumes after it."""
        gate = threading.Condition()
        gate.ahead = 0  # samples decoded or being decoded that the reader has not taken
        order = []
        with self._lock:  # every sample gets its future now: the reader waits on it, never decodes twice
            for sample, leftover in missing:
                key = (sample, resolution)
                if key in self._inflight or key in self._taken or key in self._leftovers:
                    continue
                future: Future = Future()
                if leftover:
                    self._leftovers[key] = future
                else:
                    self._inflight[key] = (future, lambda: _release(gate))
                order.append((sample, leftover, future))
        start = done = 0
        try:
            while start < len(order) and not stop.is_set():
                done = start
                try:
                    for images, labels in self.loader.blocks([s for s, _, _ in order[start:]], resolution):
                        for image, label in zip(images, labels):  # views of the decoded block
                            s, leftover, future = order[done]
                            if not leftover:
                                with gate:
                                    while gate.ahead >= self.lookahead and not drain.is_set() and not stop.is_set():
                                        gate.wait(0.1)
                                    gate.ahead += 1
                            if stop.is_set():
                                break
                            if leftover:
                                self.store.put_many([(sample_key(s, resolution, self.loader.channels), image,
                                                      int(label))])
                                future.set_result(None)
                            else:
                                future.set_result((image, int(label)))
                            done += 1
                        if stop.is_set():
                            break
                except (tf.errors.OpError, ValueError):
                    # a read or decode failed in the next block: its samples through Python (a bad
                    # file named, or skipped), then the pipeline again after them
                    for s, leftover, future in order[done:done + BLOCK]:
                        _chain(future, self._pool.submit(self.decode_and_put if leftover else self.loader.decode, s,
                                                         resolution))
                    done = min(len(order), done + BLOCK)
                start = done if done > start or stop.is_set() else len(order)
        except BaseException as exc:  # unexpected: the reader must fail, not wait for ever
            for _, _, future in order:
                if not future.done():
                    future.set_exception(exc)
            raise
        if done < len(order):  # stopped: the reader of this epoch is gone, or the next epoch began
            with self._lock:
                for s, leftover, future in order[done:]:
                    if not future.done():
                        books = self._leftovers if leftover else self._inflight
                        if books.pop((s, resolution), None) is not None:
                            future.cancel()
                        else:  # the reader took it already: it waits on it
                            _chain(future, self._pool.submit(
                                self.decode_and_put if leftover else self.loader.decode, s, resolution))

    # -- the reader's side -----------------------------------------------------------------------

    def decode_and_put(self, sample: int, resolution: Resolution) -> None:
        """`sample` decoded (`Loader.decode`) and put into the store (unless skipped)."""
        decoded = self.loader.decode(sample, resolution)
        if decoded is not None:
            self.store.put_many([(sample_key(sample, resolution, self.loader.channels), *decoded)])

    def take(self, sample: int, resolution: Resolution) -> Optional[Future]:
        """The prefetched future of `sample` (None if there is none), removed from the
        prefetcher's books; the prefetcher no longer prepares `sample`."""
        with self._lock:
            entry = self._inflight.pop((sample, resolution), None)
            self._taken.add((sample, resolution))
        if entry is None:
            return None
        entry[1]()  # its slot is free again
        return entry[0]

    def complete(self, samples: List[int], resolution: Resolution, got: List[Optional[Sample]],
                 missing: Sequence[int]) -> List[Tuple[bytes, np.ndarray, int]]:
        """Fills `got[j]` for j in `missing` (prefetched, else read and decoded now; None if
        skipped); returns the new (key, image, label) items for the store. Every sample of the
        batch is taken (`take`). Raises the decode's error, naming the file."""
        futures = {}
        for j, s in enumerate(samples):
            future = self.take(s, resolution)
            if j in missing:
                futures[j] = future or self._read_pool.submit(self.loader.decode, s, resolution)
        new = []
        for j, future in futures.items():
            got[j] = future.result()  # raises its error, with the file's path
            if got[j] is not None:
                new.append((sample_key(samples[j], resolution, self.loader.channels), *got[j]))
        return new

    def finish_leftovers(self, leftovers: Sequence[int], resolution: Resolution) -> None:
        """Waits until the epoch's leftovers are in the store (decoding those the prefetcher
        has not started), so that their errors surface in the epoch that decodes them:
        ValueError naming the file with on_error="raise", a warning with "skip"."""
        if self._drain is not None:
            self._drain.set()  # the reader has taken its whole share: the prefetcher runs to its end
        if self._thread is not None:
            self._thread.join()  # every leftover has its future
        futures = []
        with self._lock:
            for sample in leftovers:
                future = self._leftovers.pop((sample, resolution), None)
                if future is None and not self.store.locate(
                        [sample_key(sample, resolution, self.loader.channels)])[0]:
                    future = self._read_pool.submit(self.decode_and_put, sample, resolution)
                if future is not None:
                    futures.append(future)
        for future in futures:
            future.result()  # raises the decode's error, with the file's path

    def close(self) -> None:
        """Stops the feeder and the reading threads."""
        if self._stop is not None:
            self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._read_pool.shutdown(wait=True, cancel_futures=True)


def _release(gate: threading.Condition) -> None:
    """The reader took a prefetched sample: the feeder may prepare one more."""
    with gate:
        gate.ahead -= 1
        gate.notify()


def _chain(target: Future, source: Future) -> None:
    """`target` gets `source`'s result or exception when it is done."""
    def copy(done: Future) -> None:
        if target.done():
            return
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())
    source.add_done_callback(copy)
