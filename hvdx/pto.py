"""The parallel tensor operator, PTO (shi2021 sec. 4.2, eqs. 12-14).

After gradient aggregation every rank of a process set holds the same tensors, and a
replicated computation r = OP(g) (eq. 12) does the same work P times. PTO splits it:
rank p computes its share r[p] = OP(g[p]) (eq. 13) and one all-gather assembles r on every
rank (eq. 14).

    norms = hvdx.pto.parallel_map(lambda w: tf.reduce_sum(tf.square(w)), weights)   # [L]
    y = hvdx.pto.parallel_elementwise(tf.math.sqrt, x)                               # = sqrt(x)

Two kinds of op:

- per tensor (`parallel_map`): OP maps each tensor (or tuple of tensors) to a result of one
  fixed shape, e.g. a layer's squared norms for LARS. Shares are whole tensors, balanced by
  element count (`partition`: the paper splits by layer, which is lopsided: ResNet-50's
  tensors range from 64 to 2.4M elements). Each tensor's result is computed by exactly one
  rank with the same op on the same data as the replicated computation, and the all-gather
  copies it: the result is bit-identical to the replicated one on every rank.
- per element range (`parallel_elementwise`): OP is elementwise on a (long) tensor; rank p
  computes a contiguous range of elements (eq. 13 literally), the ranges are all-gathered
  and concatenated: bit-identical too.

Shares depend only on the sizes and the number of ranks: deterministic and identical on
every rank, with no communication to agree on them; more ranks than tensors leaves some
ranks with an empty share (they still join the all-gather). Collective: every rank of the
process set calls the same function with the same sizes and the same name, in the same
order. Without Horovod initialised (or on a single rank) the op runs replicated, locally.
Tensors must have static shapes (ValueError otherwise).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx.arguments import integer
from hvdx.topology import set_rank_and_size

__all__ = ["Shares", "element_ranges", "parallel_elementwise", "parallel_map", "partition", "set_rank_and_size"]

#: What one op costs beside its elements, in elements (a kernel dispatch of a few microseconds
#: reads this many float32s on a CPU core): partition() charges it to every tensor, so that a
#: rank given many tiny tensors is not counted as idle.
OP_OVERHEAD_ELEMENTS = 16384

Items = Union[tf.Tensor, Tuple[tf.Tensor, ...]]


@dataclass(frozen=True)
class Shares:
    """Which tensors each rank computes: `parts[p]` holds tensor indices in ascending order."""

    parts: Tuple[Tuple[int, ...], ...]
    loads: Tuple[int, ...]

    @property
    def width(self) -> int:
        """The largest share (every rank's block is padded to it for the all-gather)."""
        return max((len(p) for p in self.parts), default=0)

    @property
    def imbalance(self) -> float:
        """The largest load over the mean load (1.0 = perfectly balanced)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0

    def owner(self) -> List[Tuple[int, int]]:
        """For each tensor, (its rank, its position in that rank's share)."""
        out = [(0, 0)] * sum(len(p) for p in self.parts)
        for rank, part in enumerate(self.parts):
            for position, index in enumerate(part):
                out[index] = (rank, position)
        return out


def partition(sizes: Sequence[int], parts: int, overhead: int = OP_OVERHEAD_ELEMENTS) -> Shares:
    """Tensors of `sizes` elements split into `parts` shares of balanced cost (size + overhead).

    Longest processing time first: tensors in order of decreasing cost (ties: lower index
    first) each go to the share of least cost so far (ties: lower rank). The largest share
    is then at most 4/3 of the optimum (Graham 1969) and never more than the mean plus one
    tensor. Pure Python on the sizes: the same on every rank.
    """
    parts = integer(parts, "parts", 1, expected="a positive int")
    if overhead < 0:
        raise ValueError(f"overhead must be >= 0, got {overhead!r}")
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be >= 0, got {sizes}")
    order = sorted(range(len(sizes)), key=lambda i: (-(sizes[i] + overhead), i))
    heap = [(0, rank) for rank in range(parts)]
    members: List[List[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in order:
        load, rank = heapq.heappop(heap)
        members[rank].append(i)
        loads[rank] = load + sizes[i] + overhead
        heapq.heappush(heap, (loads[rank], rank))
    return Shares(tuple(tuple(sorted(m)) for m in members), tuple(loads))


def element_ranges(length: int, parts: int, align: int = 16) -> List[Tuple[int, int]]:
    """`parts` contiguous ranges covering [0, length), of equal size up to `align` elements
    (range starts are multiples of `align`, so that 64-byte vector loads stay aligned)."""
    parts = integer(parts, "parts", 1)
    length = integer(length, "length", 0)
    step = -(-length // parts)
    step = -(-step // align) * align if align > 1 else step
    return [(min(p * step, length), min((p + 1) * step, length)) for p in range(parts)]


def _as_tuple(item: Items) -> Tuple[tf.Tensor, ...]:
    return tuple(item) if isinstance(item, (tuple, list)) else (item,)


def _num_elements(item: Items) -> int:
    total = 0
    for t in _as_tuple(item):
        n = t.shape.num_elements()
        if n is None:
            raise ValueError(f"parallel_map needs tensors of static shape, got {t.shape}")
        total += n
    return total


def parallel_map(op: Callable[..., tf.Tensor], items: Sequence[Items], *, output_shape: Sequence[int] = (),
                 output_dtype: tf.DType = tf.float32, process_set: Optional[hvd.ProcessSet] = None,
                 name: str = "hvdx.pto", sizes: Optional[Sequence[int]] = None) -> tf.Tensor:
    """[op(*item) for item in items], stacked: shape [len(items), *output_shape] (eqs. 12-14).

    items: tensors, or tuples of tensors (op receives the tuple's members as arguments),
      identical on every rank of `process_set` (default: all ranks).
    op: returns `output_shape` / `output_dtype` for every item.
    name: the all-gather's name: unique among collectives in flight, the same on every rank.
    sizes: the cost of each item for the shares (default: its number of elements).
    """
    items = list(items)
    if not items:
        return tf.zeros([0, *output_shape], output_dtype)
    rank, size = set_rank_and_size(process_set)
    if size == 1:
        return tf.stack([tf.ensure_shape(tf.cast(op(*_as_tuple(item)), output_dtype), output_shape) for item in items])
    shares = partition(sizes if sizes is not None else [_num_elements(item) for item in items], size)
    # An empty share computes the cheapest item into its (discarded) padding row: in a graph
    # its all-gather then waits for the same inputs as everyone's. With a constant block it
    # would start first thing, and Horovod's all-gather appears to hold an executor thread until all
    # ranks join, so the collectives that produce the items (the gradient aggregation) never
    # start on this rank while the other ranks wait for them there (a hang, seen on 2 x 2).
    indices = shares.parts[rank] or (min(range(len(items)), key=lambda i: (_num_elements(items[i]), i)),)
    mine = [tf.ensure_shape(tf.cast(op(*_as_tuple(items[i])), output_dtype), output_shape) for i in indices]
    block = tf.stack(mine + [tf.zeros(output_shape, output_dtype)] * (shares.width - len(mine)))
    gathered = hvd.allgather(block, name=name, process_set=process_set or hvd.global_process_set)
    gathered = tf.ensure_shape(gathered, [size * shares.width, *output_shape])
    where = [owner * shares.width + position for owner, position in shares.owner()]
    return tf.gather(gathered, where)


def parallel_elementwise(op: Callable[[tf.Tensor], tf.Tensor], tensor: tf.Tensor, *,
                         process_set: Optional[hvd.ProcessSet] = None, name: str = "hvdx.pto.elementwise"
                         ) -> tf.Tensor:
    """op(tensor) for an elementwise op, each rank computing one contiguous range of the
    flattened tensor (eq. 13) and an all-gather assembling them (eq. 14)."""
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.shape.is_fully_defined():
        raise ValueError(f"parallel_elementwise needs a tensor of static shape, got {tensor.shape}")
    rank, size = set_rank_and_size(process_set)
    if size == 1:
        return op(tensor)
    flat = tf.reshape(tensor, [-1])
    ranges = element_ranges(int(flat.shape[0]), size)
    width = max(b - a for a, b in ranges)
    start, stop = ranges[rank]
    mine = op(flat[start:stop])
    if stop - start < width:
        mine = tf.concat([mine, tf.zeros([width - (stop - start)], mine.dtype)], axis=0)
    gathered = hvd.allgather(mine, name=name, process_set=process_set or hvd.global_process_set)
    parts = [gathered[p * width:p * width + (b - a)] for p, (a, b) in enumerate(ranges)]
    return tf.reshape(tf.concat(parts, axis=0), tensor.shape)

