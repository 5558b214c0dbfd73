"""One rank's reads of its share from the node store (shi2021 sec. 4.1, Fig. 5): the serving
side of DataCache, called once per batch by the tf.data pipeline (hvdx/data/pipeline.py).

On an epoch's first batch the reader plans the epoch (`start_epoch`: its share from the
split, whether all of it is in the resolution's slab, and the prefetcher started on what
the store lacks). With a slab, a batch is its slots (the pipeline gathers the pixels); in
epoch 1 `fill_slab` first makes sure the batch's samples are in the slab (prefetched or
decoded now, put in one transaction). Without a slab (no fixed resolution, or no room for
the node's whole part) `read_values` copies the batch out of the store's LMDB values. A
skipped (undecodable) sample is replaced in its batch by another sample of that batch.
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from hvdx.data.decode import Resolution
from hvdx.data.loader import Loader
from hvdx.data.prefetch import Prefetcher
from hvdx.data.split import RankSplit
from hvdx.data.store import NodeStore, Sample, Slab, sample_key

__all__ = ["EpochPlan", "Reader", "replace_skipped"]


class EpochPlan(NamedTuple):
    """What `Reader.start_epoch` decided for one epoch."""

    samples: np.ndarray  # the rank's share, in reading order (int64)
    in_slab: bool  # every one of them is in the resolution's slab
    leftovers: List[int]  # leftovers (remainder="drop") the prefetcher puts into the store


class Reader:
    """Serves one rank's share (`split`) from `store`, at one channel count (the loader's);
    `prefetcher` fills what the store lacks, `loader` reads and decodes."""

    def __init__(self, store: NodeStore, split: RankSplit, loader: Loader, prefetcher: Prefetcher) -> None:
        self.store, self.split, self.loader, self.prefetcher = store, split, loader, prefetcher
        self.home_part = split.part  # the part the store's metadata names: its slabs' (any other: values)
        self.channels = loader.channels
        self._lock = threading.Lock()
        self._slabs: Dict[Tuple[int, int], Optional[Slab]] = {}
        self._full_slabs: set = set()  # resolutions whose slab holds the whole part

    def slab(self, resolution: Resolution, create: bool = True) -> Optional[Slab]:
        """The node's slab at `resolution` (None: no fixed resolution, no room for it, or a part
        other than the one the store was opened for, after a re-split; or not made yet by
        the node's ranks and not `create`)."""
        if resolution is None or not (self.split.part is self.home_part or
                                      np.array_equal(self.split.part, self.home_part)):
            return None
        with self._lock:
            if resolution not in self._slabs:
                slab = self.store.slab(resolution, self.channels, self.split.part, create)
                if slab is None and not create:
                    return None  # asked again by the pipeline, which may make it
                self._slabs[resolution] = slab
            return self._slabs[resolution]

    def key(self, sample: int, resolution: Resolution) -> bytes:
        """`sample`'s key in the store at `resolution` and the loader's channel count."""
        return sample_key(sample, resolution, self.channels)

    def resplit(self, split: RankSplit) -> None:
        """Serves `split` from now on (a membership change): the next epoch plans from it; the
        resolution's slab is looked up again (the store's slab serves only the part it was
        made for: another part reads from the store's LMDB values)."""
        self.prefetcher.stop()
        with self._lock:
            self.split = split
            self._slabs.clear()
            self._full_slabs.clear()

    def start_epoch(self, epoch: int, resolution: Resolution) -> EpochPlan:
        """Plans `epoch` at `resolution` and starts the prefetcher on the samples of the
        rank's share and leftovers that the store lacks, in reading order."""
        share, leftover = self.split.share(epoch)
        slab = self.slab(resolution)
        self.prefetcher.stop()
        if slab is not None and (resolution in self._full_slabs or self.store.slab_complete(slab)):
            # every sample of the node's part (so of the share and the leftovers) is in the
            # slab: nothing to look up or prefetch, no Python per sample
            self._full_slabs.add(resolution)
            return EpochPlan(share.astype(np.int64), True, [])
        share_list = list(dict.fromkeys(int(s) for s in share))  # pad may repeat a sample
        leftover_list = [int(s) for s in leftover] if not self.store.full else []
        wanted = share_list + leftover_list
        where = self.store.locate(self.key(s, resolution) for s in wanted)
        if slab is not None and np.all(where == 2) and np.all(
                self.store.locate(self.key(int(s), resolution) for s in self.split.part) == 2):
            # slab slots are never taken back: full from now on, for every process of the node
            # and later runs (a restarted job: one look-up instead of one per sample)
            self.store.mark_slab_complete(slab)
            self._full_slabs.add(resolution)
        missing = [(s, j >= len(share_list)) for j, (s, w) in enumerate(zip(wanted, where))
                   if not w and not self.loader.is_bad(s)]
        if missing:
            self.prefetcher.start(missing, resolution)
        in_slab = slab is not None and bool(np.all(where[:len(share_list)] == 2))
        return EpochPlan(share.astype(np.int64), in_slab, [s for s, left in missing if left])

    def finish_epoch(self, plan: EpochPlan, resolution: Resolution) -> None:
        """After the epoch's last batch: waits for its leftovers to be in the store (their
        decode errors are this epoch's: ValueError naming the file with on_error="raise")."""
        self.prefetcher.finish_leftovers(plan.leftovers, resolution)

    def fill_slab(self, samples: np.ndarray, resolution: Tuple[int, int], slab: Slab) -> np.ndarray:
        """Makes sure the samples of one batch are in the slab (decoding what the store lacks);
        returns the ids to gather (a skipped sample replaced by another of its batch)."""
        samples = [int(s) for s in samples]
        keys = [self.key(s, resolution) for s in samples]
        where = self.store.locate(keys)
        got: List[Optional[Sample]] = [None] * len(samples)
        in_values = [j for j, w in enumerate(where) if w == 1]  # stored without the slab: copy them in
        for j, sample in zip(in_values, self.store.get_many([keys[j] for j in in_values])):
            if sample is not None:
                slab.write(int(slab.slots([samples[j]])[0]), *sample)
        missing = [j for j, w in enumerate(where) if w == 0]
        self.store.count_hits(len(samples) - len(missing), len(missing))
        self.store.put_many(self.prefetcher.complete(samples, resolution, got, missing))  # pixels into the slab
        if not missing or all(got[j] is not None for j in missing):
            return np.asarray(samples, np.int64)
        ok = [w != 0 or got[j] is not None for j, w in enumerate(where)]
        return np.asarray(replace_skipped(samples, ok, self.loader.catalog.describe), np.int64)

    def read_values(self, samples: np.ndarray, resolution: Resolution) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(images, labels, ids) of one batch without a slab: from the store's values, else
        prefetched, else read and decoded now (and put into the store)."""
        samples = [int(s) for s in samples]
        keys = [self.key(s, resolution) for s in samples]
        if resolution is not None:  # the common case, all hits: one copy into the batch
            batch = self.store.get_batch(keys, (*resolution, self.channels))
            if batch is not None:
                for s in samples:
                    self.prefetcher.take(s, resolution)
                return batch[0], batch[1], np.asarray(samples, np.int64)
        got: List[Optional[Sample]] = self.store.get_many(keys)
        self.store.put_many(self.prefetcher.complete(samples, resolution, got,
                                                     [j for j, g in enumerate(got) if g is None]))
        ids = replace_skipped(samples, [g is not None for g in got], self.loader.catalog.describe)
        by_id = {s: g for s, g in zip(samples, got) if g is not None}
        images = np.stack([by_id[s][0] for s in ids])
        labels = np.asarray([by_id[s][1] for s in ids], np.int64)
        return images, labels, np.asarray(ids, np.int64)


def replace_skipped(samples: List[int], ok: Sequence[bool], describe: Callable[[int], str]) -> List[int]:
    """The batch's ids with each sample that is not `ok` (undecodable, skipped) replaced by
    the next one of the batch that is (cyclically). Raises ValueError naming every file
    (`describe`) when none is."""
    if not any(ok):
        raise ValueError("hvdx.data: every sample of a batch is undecodable: "
                         + ", ".join(describe(s) for s in samples))
    return [s if ok[j] else samples[next(i for i in itertools.chain(range(j, len(ok)), range(j)) if ok[i])]
            for j, s in enumerate(samples)]
