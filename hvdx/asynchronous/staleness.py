"""The staleness of every update applied to a shared model (Gimpel, Das, Smith, "Distributed
Asynchronous Online Learning for Natural Language Processing", CoNLL 2010, eq. 5: the t-th
update uses parameters theta(tau(t)), and t - tau(t) "captures the staleness").

Here: the number of other updates applied to the node's shared model between this process's
read of it and its own update (HvdxSharedUpdate's version before the update minus the
version HvdxSharedRead returned). 0 means the update was computed on the newest model.
"""
from __future__ import annotations

from typing import Dict

import tensorflow as tf

from hvdx.arguments import integer

__all__ = ["Staleness"]


class Staleness:
    """A histogram of staleness values kept in TensorFlow variables (recorded inside traced
    steps); values >= bins - 1 share the last bin, `max` keeps the largest exactly."""

    def __init__(self, bins: int = 256) -> None:
        bins = integer(bins, "bins", 2)
        self.bins = bins
        self.counts = tf.Variable(tf.zeros([bins], tf.int64), trainable=False, name="staleness_counts")
        self.max = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="staleness_max")
        self.total = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="staleness_total")

    def record(self, value: tf.Tensor) -> None:
        """Counts one update of staleness `value` (int64 scalar, >= 0)."""
        value = tf.maximum(tf.cast(value, tf.int64), 0)
        self.counts.scatter_nd_add([[tf.minimum(value, self.bins - 1)]], [1])
        self.max.assign(tf.maximum(self.max, value))
        self.total.assign_add(value)

    def summary(self) -> Dict[str, object]:
        """{"updates", "mean", "max", "histogram": {staleness: count} (nonzero bins; the last
        bin counts every value >= bins - 1)}."""
        counts = self.counts.numpy()
        n = int(counts.sum())
        return {"updates": n, "mean": float(self.total.numpy()) / n if n else 0.0, "max": int(self.max.numpy()),
                "histogram": {int(i): int(c) for i, c in enumerate(counts) if c}}

    def reset(self) -> None:
        self.counts.assign(tf.zeros_like(self.counts))
        self.max.assign(0)
        self.total.assign(0)


def merge(summaries) -> Dict[str, object]:
    """One summary of several processes' (e.g. every rank's, after an allgather)."""
    hist: Dict[int, int] = {}
    for s in summaries:
        for k, c in s["histogram"].items():
            hist[int(k)] = hist.get(int(k), 0) + int(c)
    n = sum(hist.values())
    total = sum(s["mean"] * s["updates"] for s in summaries)
    return {"updates": n, "mean": total / n if n else 0.0, "max": max((s["max"] for s in summaries), default=0),
            "histogram": dict(sorted(hist.items()))}
