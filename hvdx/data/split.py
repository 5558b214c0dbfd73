"""The split of a data set over a job's nodes and ranks (shi2021 sec. 4.1): which node keeps
which samples, and which rank reads which of them in each epoch.

For N samples on m nodes of n ranks each:

- `deal`: a seeded permutation (`split_seed`) of the units (samples, or TFRecord files,
  which are dealt whole) dealt round-robin to the nodes; node j keeps only its part
  (`node_part`).
- `samples_per_rank`: every rank reads the same number of samples per epoch,
  floor(min part / n) with `remainder="drop"`, ceil(max part / n) with `remainder="pad"`.
- `epoch_share`: in epoch e every rank of a node shuffles the node's part with the same
  seed (`seed`, e) and local rank l takes every n-th sample from position l. With "drop"
  the at most n - 1 samples of the part left over (different ones every epoch) are dealt
  the same way as leftovers, which the rank decodes into the store without reading them;
  with "pad" the order is extended with the node's own first samples.
- `assign`: every rank's `Share` of an epoch, for every node: the one function from
  (parts, epoch, ranks per node, seed, remainder) to what each rank reads.

Everything here is a pure function of its arguments except `Placement.current` (hvdx's or
Horovod's topology) and `catalog_part` (it indexes TFRecord files and, on several nodes,
agrees on the parts' sizes through Horovod).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Sequence, Tuple, Union

import numpy as np

from hvdx.data.catalog import ImageFolder, TFRecordShards
from hvdx.data.disk import DiskCache

__all__ = ["REMAINDERS", "Placement", "RankSplit", "Share", "assign", "catalog_part", "deal", "epoch_share",
           "node_part", "samples_per_rank"]

REMAINDERS = ("drop", "pad")


@dataclass(frozen=True)
class Placement:
    """This process' place: node `node` of `num_nodes`, local rank `local_rank` of `local_size`.

    Raises ValueError when a rank lies outside its range."""

    node: int = 0
    num_nodes: int = 1
    local_rank: int = 0
    local_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.node < self.num_nodes and 0 <= self.local_rank < self.local_size):
            raise ValueError(f"placement out of range: {self}")

    @staticmethod
    def current() -> "Placement":
        """From hvdx's topology (`hvdx.init()`), else Horovod's ranks, else one process."""
        from hvdx.topology import initialized, topology

        if initialized():
            t = topology()
            return Placement(t.node, t.num_nodes, t.local_rank, t.local_size)
        import horovod.tensorflow as hvd

        if hvd.is_initialized():
            return Placement(hvd.cross_rank(), hvd.cross_size(), hvd.local_rank(), hvd.local_size())
        return Placement()


class Share(NamedTuple):
    """One rank's samples of one epoch."""

    samples: np.ndarray  # read, in reading order
    leftovers: np.ndarray  # decoded into the node's store without being read (remainder="drop")


def deal(count: int, num_nodes: int, node: int, split_seed: int) -> np.ndarray:
    """The positions (sorted) among `count` units that node `node` of `num_nodes` keeps: a
    permutation seeded by `split_seed`, dealt round-robin."""
    return np.sort(np.random.default_rng(split_seed).permutation(count)[node::num_nodes])


def node_part(ids: np.ndarray, num_nodes: int, node: int, split_seed: int) -> np.ndarray:
    """The samples node `node` keeps (sorted): `ids` dealt by `deal`."""
    return np.sort(np.asarray(ids)[deal(len(ids), num_nodes, node, split_seed)])


def samples_per_rank(part_sizes: Sequence[int], local_size: int, remainder: str) -> int:
    """How many samples every rank reads per epoch, given every node's part size.

    Raises ValueError for a `remainder` other than "drop" and "pad"."""
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
    if remainder == "drop":
        return min(part_sizes) // local_size
    return math.ceil(max(part_sizes) / local_size)


def epoch_share(part: np.ndarray, epoch: int, seed: int, local_rank: int, local_size: int,
                per_rank: int) -> Share:
    """Local rank `local_rank`'s share of its node's `part` in `epoch`: (its samples in reading
    order, the part's leftovers it decodes into the store without reading them: only with
    remainder="drop", i.e. when the part holds more than per_rank * local_size samples)."""
    order = np.asarray(part)[np.random.default_rng([seed, epoch]).permutation(len(part))]
    used = per_rank * local_size
    if len(order) < used:  # remainder="pad": the node's own first samples again
        order = np.resize(order, used)
    return Share(order[local_rank:used:local_size], order[used:][local_rank::local_size])


def assign(parts: Sequence[np.ndarray], epoch: int, local_size: int, seed: int,
           remainder: str) -> List[List[Share]]:
    """Every rank's share of `epoch`: `assign(...)[j][l]` is local rank l of node j's, given
    every node's part (`parts[j]`, e.g. `node_part(ids, len(parts), j, split_seed)`).

    With "drop" every sample of the parts is read at most once and read or left over
    exactly once; with "pad" every one is read at least once. Every rank reads
    `samples_per_rank([len(p) for p in parts], local_size, remainder)` samples.
    Raises ValueError for a bad `remainder`."""
    per_rank = samples_per_rank([len(p) for p in parts], local_size, remainder)
    return [[epoch_share(part, epoch, seed, l, local_size, per_rank) for l in range(local_size)] for part in parts]


@dataclass(frozen=True, eq=False)
class RankSplit:
    """One rank's view of the split: its node's `part` (sorted sample ids), its `placement`,
    the shuffling `seed` and the samples every rank reads per epoch (`per_rank`)."""

    part: np.ndarray
    placement: Placement
    seed: int
    per_rank: int

    def share(self, epoch: int) -> Share:
        """This rank's `Share` of `epoch`."""
        p = self.placement
        return epoch_share(self.part, epoch, self.seed, p.local_rank, p.local_size, self.per_rank)


def catalog_part(catalog: Union[ImageFolder, TFRecordShards], placement: Placement, split_seed: int,
                 disk: DiskCache) -> Tuple[np.ndarray, List[int]]:
    """(this node's part of `catalog`, every node's part size). Samples of a folder tree are
    dealt one by one; TFRecord files whole (this node's are fetched through `disk` and
    indexed; the other nodes' sizes come from a Horovod allgather: collective).

    Raises ValueError when there are fewer TFRecord files than nodes, or several nodes
    without Horovod initialized."""
    p = placement
    if isinstance(catalog, ImageFolder):
        ids = catalog.ids()
        sizes = [len(range(j, len(ids), p.num_nodes)) for j in range(p.num_nodes)]  # round-robin
        return node_part(ids, p.num_nodes, p.node, split_seed), sizes
    if len(catalog.shards) < p.num_nodes:
        raise ValueError(f"tfrecords: {len(catalog.shards)} file(s) cannot be dealt to {p.num_nodes} nodes")
    mine = deal(len(catalog.shards), p.num_nodes, p.node, split_seed)
    part = np.sort(catalog.index([int(s) for s in mine], disk))
    return part, _node_sizes(len(part), p)


def _node_sizes(own: int, placement: Placement) -> List[int]:
    """Every node's part size (TFRecord parts are known only to their node): an allgather
    over Horovod when the job has several nodes."""
    if placement.num_nodes == 1:
        return [own]
    import horovod.tensorflow as hvd

    if not hvd.is_initialized():
        raise ValueError("tfrecords on several nodes need Horovod initialized (hvdx.init()) to agree on sizes")
    entries = hvd.allgather_object((placement.node, own), name="hvdx.data.node_sizes")
    return [size for _, size in sorted(dict(entries).items())]
