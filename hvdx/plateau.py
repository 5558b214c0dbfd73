"""Loss-plateau detection: DASO's cycling phase (coquelin2021, sec. 3) and the communication
policy's switch (`hvdx.callbacks.CommunicationPolicy`) use the same rule.

DASO: "Each time the training loss plateaus, B and W are reduced by a factor of two": a plateau
is `patience` + 1 epochs in a row whose loss is not lower than the best so far by more
than the relative `threshold` (the paper's "set percentage threshold"; the rule of Keras'
ReduceLROnPlateau). Once a plateau is reported the count starts again, so the next report
needs another `patience` + 1 epochs.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict

from hvdx.arguments import integer, real

__all__ = ["PlateauDetector"]


@dataclass
class PlateauDetector:
    """Reports a plateau of a minimised metric (the epoch's training loss).

    patience: epochs without improvement tolerated before a plateau is reported.
    threshold: relative improvement that counts: loss < best - threshold * |best|.
    """

    patience: int = 2
    threshold: float = 0.05
    best: float = math.inf
    bad_epochs: int = 0

    def __post_init__(self) -> None:
        self.patience = integer(self.patience, "patience", 0)
        self.threshold = real(self.threshold, "threshold", 0.0, 1.0, high_open=True,
                              expected="a relative improvement in [0, 1)")

    def update(self, loss: float) -> bool:
        """Feeds one epoch's loss; True when this epoch completes a plateau."""
        loss = float(loss)
        if math.isnan(loss):
            raise ValueError("the training loss is NaN: no plateau can be detected in it (check the learning "
                             "rate, or use a LossScaleOptimizer with mixed precision)")
        if math.isinf(self.best) or loss < self.best - self.threshold * abs(self.best):
            self.best = loss
            self.bad_epochs = 0
            return False
        self.bad_epochs += 1
        if self.bad_epochs > self.patience:
            self.bad_epochs = 0
            return True
        return False

    def reset(self) -> None:
        """Forgets the best loss and the count (a new phase starts)."""
        self.best = math.inf
        self.bad_epochs = 0

    def state(self) -> Dict[str, Any]:
        """A JSON-serialisable copy (inf is written as None)."""
        state = asdict(self)
        state["best"] = None if math.isinf(self.best) else self.best
        return state

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> "PlateauDetector":
        state = dict(state)
        state["best"] = math.inf if state.get("best") is None else float(state["best"])
        return cls(**state)
