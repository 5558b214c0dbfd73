"""DASO's schedule: when to average parameters globally, blocking or not (coquelin2021, sec. 3).

A pure, serialisable state machine: it decides, it never communicates.

- Phases, by epoch: warm-up (the first `warmup_epochs`) and cool-down (the last
  `cooldown_epochs`) synchronise globally after every step, blocking; the epochs between
  are the cycling phase.
- Cycling: every B steps a global average starts and training goes on; W steps later the
  stale average is merged (eq. 1) with S, the staleness measured at that moment. B starts
  at `max_global_skips` and W at B/4 (at least 1); on each loss plateau both halve (at
  least 1); a plateau at B = W = 1 resets both to their initial values.
- Groups: each global synchronisation is done by one group (the ranks of one local rank,
  one per node), the next one by the next group ("the role of global synchronization
  rotates between groups").
- Epochs end with a drain: the exchange in flight, if any, is merged, then all ranks are
  averaged, so every epoch's cycle starts again from identical parameters.

Where this differs from HeAT's DASO, and why: docs/daso.md.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from hvdx.arguments import integer
from hvdx.plateau import PlateauDetector

__all__ = ["Action", "Schedule", "WARMUP", "CYCLING", "COOLDOWN"]

WARMUP, CYCLING, COOLDOWN = "warmup", "cycling", "cooldown"


@dataclass(frozen=True)
class Action:
    """What to do after one step's local update.

    merge_group / staleness: merge the exchange group `merge_group` started `staleness`
      steps ago (eq. 1), then broadcast the result inside each node (Figure 4).
    start_group: start a non-blocking global average of this step's parameters in that group.
    blocking_group: average the parameters in that group now, blocking (warm-up, cool-down).
    """

    step: int
    merge_group: Optional[int] = None
    staleness: int = 0
    start_group: Optional[int] = None
    blocking_group: Optional[int] = None


@dataclass
class Schedule:
    """The state machine of one DASO run on `num_groups` groups (ranks per node)."""

    total_epochs: int
    warmup_epochs: int = 1
    cooldown_epochs: int = 1
    max_global_skips: int = 4
    num_groups: int = 1
    plateau: PlateauDetector = field(default_factory=PlateauDetector)
    # -- position --------------------------------------------------------------------
    epoch: int = 0
    step: int = 0
    step_in_epoch: int = 0
    syncs: int = 0
    B: int = 0
    W: int = 0
    pending_group: Optional[int] = None
    pending_step: Optional[int] = None

    def __post_init__(self) -> None:
        self.total_epochs = integer(self.total_epochs, "total_epochs", 1)
        self.warmup_epochs = integer(self.warmup_epochs, "warmup_epochs", 0)
        self.cooldown_epochs = integer(self.cooldown_epochs, "cooldown_epochs", 0)
        self.max_global_skips = integer(self.max_global_skips, "max_global_skips", 1)
        self.num_groups = integer(self.num_groups, "num_groups", 1)
        if self.warmup_epochs + self.cooldown_epochs > self.total_epochs:
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) + cooldown_epochs ({self.cooldown_epochs}) "
                             f"exceed total_epochs ({self.total_epochs})")
        if self.B == 0:
            self.B, self.W = self.initial_skips

    # -- the rules -------------------------------------------------------------------
    @property
    def initial_skips(self) -> tuple:
        """(B, W) at the start of the cycling phase and after a reset: W = B/4, at least 1."""
        return self.max_global_skips, max(1, self.max_global_skips // 4)

    def phase_of(self, epoch: int) -> str:
        if epoch < self.warmup_epochs:
            return WARMUP
        if epoch >= self.total_epochs - self.cooldown_epochs:
            return COOLDOWN
        return CYCLING

    @property
    def phase(self) -> str:
        return self.phase_of(self.epoch)

    @property
    def blocking(self) -> bool:
        return self.phase != CYCLING

    @property
    def in_flight(self) -> bool:
        return self.pending_group is not None

    def _next_group(self) -> int:
        group = self.syncs % self.num_groups
        self.syncs += 1
        return group

    def after_step(self) -> Action:
        """Advances one step (its local update is done) and says what to do now."""
        self.step += 1
        self.step_in_epoch += 1
        if self.blocking:
            return Action(self.step, blocking_group=self._next_group())
        merge_group, staleness = None, 0
        if self.in_flight and self.step - self.pending_step >= self.W:
            merge_group, staleness = self.pending_group, self.step - self.pending_step
            self.pending_group = self.pending_step = None
        start_group = None
        if self.step_in_epoch % self.B == 0 and not self.in_flight:
            start_group = self._next_group()
            self.pending_group, self.pending_step = start_group, self.step
        return Action(self.step, merge_group=merge_group, staleness=staleness, start_group=start_group)

    def drain(self) -> Optional[Action]:
        """The exchange in flight is merged now (end of epoch, checkpoint): its Action, or None."""
        if not self.in_flight:
            return None
        action = Action(self.step, merge_group=self.pending_group, staleness=self.step - self.pending_step)
        self.pending_group = self.pending_step = None
        return action

    def end_epoch(self, loss: Optional[float]) -> List[str]:
        """Closes the epoch (after its drain) with its training loss averaged over all ranks.

        Returns what changed, e.g. ["plateau", "halve B=2 W=1"] or ["phase cycling B=4 W=1"].
        """
        if self.in_flight:
            raise RuntimeError("drain() the exchange in flight before ending the epoch")
        events: List[str] = []
        finished = self.phase
        self.epoch += 1
        self.step_in_epoch = 0
        if finished == CYCLING and self.phase == CYCLING and loss is not None and self.plateau.update(loss):
            events.append("plateau")
            if self.B == 1 and self.W == 1:
                self.B, self.W = self.initial_skips
                events.append(f"reset B={self.B} W={self.W}")
            else:
                self.B, self.W = max(1, self.B // 2), max(1, self.W // 2)
                events.append(f"halve B={self.B} W={self.W}")
        if self.phase != finished:
            if self.phase == CYCLING:
                self.B, self.W = self.initial_skips
                self.plateau.reset()
                events.append(f"phase cycling B={self.B} W={self.W}")
            else:
                events.append(f"phase {self.phase}")
        return events

    def start_epoch(self, epoch: int) -> None:
        """Jumps to `epoch` (Model.fit's initial_epoch on a resumed run); B and W are kept."""
        epoch = integer(epoch, "epoch", 0)
        if self.in_flight:
            raise RuntimeError("drain() the exchange in flight before moving to another epoch")
        if epoch != self.epoch:
            entering_cycling = self.phase != CYCLING and self.phase_of(epoch) == CYCLING
            self.epoch, self.step_in_epoch = epoch, 0
            if entering_cycling:
                self.B, self.W = self.initial_skips

    # -- serialisation ---------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        state = asdict(self)
        state["plateau"] = self.plateau.state()
        return state

    def to_json(self) -> str:
        return json.dumps(self.state(), sort_keys=True)

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> "Schedule":
        state = dict(state)
        state["plateau"] = PlateauDetector.from_state(state["plateau"])
        return cls(**state)

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        return cls.from_state(json.loads(text))
