"""ASSM, PASSM and PASSM+ on one node's shared model (Kungurtsev, Egan, Chatterjee,
Alistarh, "Asynchronous Optimization Methods for Efficient Training of Deep Neural Networks
with Guarantees", AAAI 2021, arXiv 1905.11845: Algorithm 1, sec. 4).

Algorithm 1 for core c: read the shared model x (an inconsistent read: no lock, blocks may
be of different versions), compute a stochastic subgradient g at it on a mini-batch, update
the core's momentum u^c <- m u^c + g (u^c is the core's own), and add -alpha u^c to the
block(s) it updates in shared memory.

- `ASSM`: every core updates the whole model, each block under its write lock ("each
  partition is protected from concurrent updates by a lock"); blocks = the layers.
- `PASSM`: the layers are split among the node's P processes by roughly equal parameter
  count (partition.py); each computes the gradient of its own layers only (restricted
  backpropagation) and adds its update lock-free with word-sized atomic fetch-and-add.
  It converges to a block-wise stationary point only (sec. 3), and may generalise worse.
- `PASSMPlus` (the paper's PASSM+, sec. 4 "PASSM Heuristic"): PASSM with full ASSM steps in
  given epochs: about the first 25% of the epochs and about 10% around every learning-rate
  decay (`paper_schedule`).

The momentum u^c is the local Keras optimizer's (e.g. SGD(lr, momentum=0.9): Keras keeps
v <- m v - lr g, x <- x + v, which is -alpha u with alpha = lr at a constant rate); its slots
are the process's own, and in PASSM only those of its own layers move.
"""
from __future__ import annotations

from typing import Iterable, List, Sequence

from hvdx.arguments import integer
from hvdx.asynchronous.method import SharedModelMethod

__all__ = ["ASSM", "PASSM", "PASSMPlus"]


class ASSM(SharedModelMethod):
    """Every process updates the whole model under per-block (per-layer) write locks; reads
    are lock-free (module docstring)."""

    label = "ASSM"
    read_mode, update_mode, read_back, partitioned = "none", "block", False, False


class PASSM(SharedModelMethod):
    """Each process differentiates and updates only its own group of layers, lock-free
    (module docstring). `variables_to_train()` is that group: in a custom loop, differentiate
    exactly those (`tape.gradient(loss, method.variables_to_train())`)."""

    label = "PASSM"
    read_mode, update_mode, read_back, partitioned = "none", "atomic", False, True


class PASSMPlus(PASSM):
    """PASSM with full ASSM steps in `full_epochs` (epoch indices, from 0).

    Args:
      full_epochs: the epochs run as ASSM (every variable, per-block locks); the others as
        PASSM. `paper_schedule(epochs, decays)` builds the paper's heuristic.
      others: as `SharedModelMethod`.
    In `Model.fit` the callback tells the method each epoch; in a custom loop call
    `set_epoch(e)` at each epoch's start (it returns True when the phase changes)."""

    label = "PASSM+"

    def __init__(self, full_epochs: Iterable[int], **kwargs) -> None:
        super().__init__(**kwargs)
        full_epochs = list(full_epochs)
        self.full_epochs = frozenset(integer(e, "full_epochs", 0, expected=f"epoch indices (ints >= 0): {full_epochs}")
                                     for e in full_epochs)

    @staticmethod
    def paper_schedule(epochs: int, decays: Sequence[int] = ()) -> List[int]:
        """sec. 4's heuristic: ASSM for the first ~25% of `epochs`, and for ~10% of them
        around each learning-rate decay epoch in `decays` (half before, half from it)."""
        epochs = integer(epochs, "epochs", 1)
        full = set(range(max(1, round(0.25 * epochs))))
        width = max(1, round(0.10 * epochs))
        for d in decays:
            start = int(d) - width // 2
            full.update(e for e in range(start, start + width) if 0 <= e < epochs)
        return sorted(full)

    def full_step(self) -> bool:
        return self.epoch in self.full_epochs

    def modes(self):
        return ("none", "block", False) if self.full_step() else ("none", "atomic", False)
