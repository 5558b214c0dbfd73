"""DASO (coquelin2021): node-local gradient averaging every step, global parameter
averaging in rotating groups, blocking (16-bit wire) or overlapped with a stale-weighted
merge (eq. 1), on a schedule of warm-up, cycling and cool-down phases.

- `hvdx.daso.schedule`: when (a pure, serialisable state machine) and `plateau` (when the
  loss has plateaued);
- `hvdx.daso.sync`: what moves (blocking, non-blocking, merge, drain) and
  `hvdx.transport.ring`: how it moves between nodes without blocking Horovod's thread;
- `hvdx.daso.optimizer.DASO` (also `hvdx.DASO`) and `hvdx.daso.keras.DASOCallback`: the
  Keras optimizer and the Model.fit glue.
"""
from hvdx.daso.keras import DASOCallback
from hvdx.daso.optimizer import DASO
from hvdx.daso.plateau import PlateauDetector
from hvdx.daso.schedule import COOLDOWN, CYCLING, WARMUP, Action, Schedule

__all__ = ["COOLDOWN", "CYCLING", "DASO", "DASOCallback", "WARMUP", "Action", "PlateauDetector", "Schedule"]
