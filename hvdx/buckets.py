"""Buckets: how one step's gradients are fused, and the record of what an aggregation produced.

A bucket is a list of `Piece`s, elements [start, stop) of flattened gradients, laid end to
end in one 1-D buffer that a strategy aggregates. `plan` chooses them (shi2021 Fig. 1:
wait-free backpropagation + tensor fusion); `AggregationRecord` tells what each bucket
produced, which variables its pieces belong to, and which element ranges of each variable
this rank's reduce-scattered slice covers (LARS/LAMB's `parallel="slices"`, shi2021 sec. 4.2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from hvdx.arguments import is_integer
from hvdx.comm.base import Aggregated

__all__ = ["AggregationObserver", "AggregationRecord", "BucketRecord", "MAX_BUCKET_ELEMENTS", "Piece", "Ranges", "plan"]

#: A bucket never holds more elements than this, so indices fit int32 (padding included).
MAX_BUCKET_ELEMENTS = 2 ** 31 - 2 ** 20
#: Element ranges [a, b) of one flattened gradient.
Ranges = List[Tuple[int, int]]
Groups = Union[None, int, Sequence[Sequence[Any]]]


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flattened gradient `index` (usually all of it)."""

    index: int
    start: int
    stop: int


def plan(sizes: Dict[int, int], dtypes: Dict[int, tf.DType], variables: Sequence[Any], *, groups: Groups,
         bucket_bytes: Optional[int], max_elements: int = MAX_BUCKET_ELEMENTS) -> List[List[Piece]]:
    """The buckets of one step.

    Args:
      sizes, dtypes: element count and dtype of each fused gradient, by gradient index.
      variables: the variables of the gradients (by index; used by variable `groups`).
      groups: Horovod's `num_groups` (an int: that many buckets of equal gradient counts), a
        list of lists of variables (one bucket each; the rest alone), or None.
      bucket_bytes: with groups None, a bucket closes once it holds this many bytes, and a
        gradient of that size or more goes alone (no fused copy of it); None: one per dtype.
      max_elements: no bucket is larger (a gradient may span two buckets).
    Returns:
      Buckets per dtype, chosen walking the gradients from last to first (backpropagation's
      order); inside a bucket the pieces keep the gradients' order.
    """
    by_dtype: Dict[tf.DType, List[int]] = {}
    for i in reversed(sorted(sizes)):  # backpropagation's order: the last layer's gradients first
        by_dtype.setdefault(dtypes[i], []).append(i)
    buckets: List[List[Piece]] = []
    for dtype, indices in by_dtype.items():
        for group in _groups(indices, sizes, variables, dtype, groups, bucket_bytes):
            buckets.extend(_cap([Piece(i, 0, sizes[i]) for i in sorted(group)], max_elements))
    return buckets


def _groups(indices: List[int], sizes: Dict[int, int], variables: Sequence[Any], dtype: tf.DType,
            groups: Groups, bucket_bytes: Optional[int]) -> List[List[int]]:
    if is_integer(groups) and groups > 0:  # Horovod's num_groups: equal counts
        n = min(int(groups), len(indices))
        return [indices[j * len(indices) // n:(j + 1) * len(indices) // n] for j in range(n)]
    if isinstance(groups, (list, tuple)):
        position = {variables[i].ref(): i for i in indices if variables[i] is not None}
        out, taken = [], set()
        for group in groups:
            members = [position[v.ref()] for v in group if v.ref() in position]
            if members:
                out.append(sorted(members))
                taken.update(members)
        return out + [[i] for i in indices if i not in taken]
    if bucket_bytes is None:
        return [indices]
    out, current, used = [], [], 0
    for i in indices:  # a bucket closes once it holds bucket_bytes (no bucket of a few bytes)
        nbytes = dtype.size * sizes[i]
        if nbytes >= bucket_bytes and current:  # a large gradient goes alone: no fused copy of it
            out.append(current)
            current, used = [], 0
        current.append(i)
        used += nbytes
        if used >= bucket_bytes:
            out.append(current)
            current, used = [], 0
    return out + ([current] if current else [])


def _cap(pieces: List[Piece], limit: int) -> List[List[Piece]]:
    """Splits a bucket so that none exceeds `limit` elements (a gradient may span two)."""
    buckets, current, used = [], [], 0
    for piece in pieces:
        start = piece.start
        while start < piece.stop:
            take = min(piece.stop - start, limit - used)
            current.append(Piece(piece.index, start, start + take))
            used += take
            start += take
            if used == limit:
                buckets.append(current)
                current, used = [], 0
    return buckets + ([current] if current else [])


@dataclass(frozen=True)
class BucketRecord:
    """One bucket of an aggregation: the strategy's result and the pieces, in buffer order."""

    result: Aggregated
    pieces: Tuple[Piece, ...]


@dataclass(frozen=True)
class AggregationRecord:
    """What one aggregation produced (graph tensors of the trace in progress).

    variables: the variables of the gradients that were aggregated, by gradient index
      (None where the caller gave none); `Piece.index` indexes it.
    buckets: each bucket's `BucketRecord`, in aggregation order.
    process_set: the Horovod process set the gradients were averaged over (None: all
      ranks); e.g. DASO's node-local set, where other nodes hold other gradients.
    """

    variables: Tuple[Any, ...]
    buckets: Tuple[BucketRecord, ...]
    process_set: Any = None

    @property
    def results(self) -> List[Aggregated]:
        """Each bucket's `hvdx.comm.Aggregated`."""
        return [bucket.result for bucket in self.buckets]

    def slice_ranges(self) -> Optional[Dict[int, Ranges]]:
        """For each gradient index, the element ranges of its flattened gradient that lie in
        this rank's reduce-scattered slices (`Aggregated.local_slice`). A slice may reach
        into a small buffer's padding: only real elements count. Every gradient of a bucket
        with a slice gets an entry (empty: another rank of the node covers it); the gradients
        of a bucket without one (averaged whole on every rank: 2DTAR's small buckets) get
        none. None if no bucket has a slice, or if a gradient spans a bucket with a slice and
        one without (its norm would be neither local nor sliced)."""
        out: Dict[int, Ranges] = {}
        whole = set()
        for bucket in self.buckets:
            local = bucket.result.local_slice
            if local is None or local[0].shape[0] is None:
                whole.update(piece.index for piece in bucket.pieces)
                continue
            lo = int(local[1])
            hi = lo + int(local[0].shape[0])
            position = 0
            for piece in bucket.pieces:
                length = piece.stop - piece.start
                a, b = max(lo, position), min(hi, position + length)
                ranges = out.setdefault(piece.index, [])
                if a < b:
                    ranges.append((piece.start + a - position, piece.start + b - position))
                position += length
        if not out or whole & set(out):
            return None
        return out

    def aggregated_variables(self) -> Dict[Any, Optional[Ranges]]:
        """variable.ref() -> this rank's slice ranges of its gradient (None where the strategy
        leaves no slices), for every variable whose gradient was averaged over all ranks."""
        ranges = self.slice_ranges()
        indices = sorted({piece.index for bucket in self.buckets for piece in bucket.pieces})
        return {self.variables[i].ref(): (ranges.get(i) if ranges is not None else None)
                for i in indices if i < len(self.variables) and self.variables[i] is not None}


class AggregationObserver:
    """Base of an optimizer that reads what each aggregation produced: when it is wrapped by
    `hvdx.DistributedOptimizer`, `observe_aggregation` is called after each aggregation (in
    the same trace) with its record, before the optimizer applies the gradients
    (`hvdx.optimizers.LARS`/`LAMB` compute their norms on the reduce-scattered slices)."""

    def observe_aggregation(self, record: AggregationRecord) -> None:
        raise NotImplementedError
