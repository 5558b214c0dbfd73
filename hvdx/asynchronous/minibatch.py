"""Asynchronous mini-batch SGD on one node's shared model (Gimpel, Das, Smith, "Distributed
Asynchronous Online Learning for Natural Language Processing", CoNLL 2010, Algorithm 1 and
eq. 5).

Algorithm 1, per thread (here: per process of the node):

    theta' <- theta
    loop: g <- sum of the mini-batch's gradients at theta'
          acquireLock(theta); theta <- updateParams(theta, g); theta' <- theta; releaseLock(theta)

`AsyncMiniBatch()` is exactly that: the update and the copy back happen under one lock on
the whole vector (HvdxSharedUpdate mode "whole" with read_back). `AsyncMiniBatch(lock=False)`
drops the lock (every element still by an atomic fetch-and-add, and a lock-free read):
Hogwild-style, for comparison. updateParams is the local Keras optimizer's step (plain SGD in
the paper; momentum is the optimizer's own, local to the process).
"""
from __future__ import annotations

from hvdx.asynchronous.method import SharedModelMethod

__all__ = ["AsyncMiniBatch"]


class AsyncMiniBatch(SharedModelMethod):
    """gimpel2010 Algorithm 1 (module docstring). Args: `lock` (default True: the paper's
    lock on the whole vector), and those of `SharedModelMethod`."""

    label = "AsyncMiniBatch"
    partitioned = False

    def __init__(self, *, lock: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lock = bool(lock)
        if self.lock:
            self.read_mode, self.update_mode, self.read_back = "whole", "whole", True
        else:
            self.read_mode, self.update_mode, self.read_back = "none", "atomic", False
            self.label = "AsyncMiniBatch(lock=False)"
