"""DASO (coquelin2021): node-local gradient averaging every step, global parameter
averaging in rotating groups, blocking (16-bit wire) or overlapped with a stale-weighted
merge (eq. 1), on a schedule of warm-up, cycling and cool-down phases.

- `hvdx.daso.schedule`: when (a pure, serialisable state machine; plateaus: `hvdx.plateau`);
- `hvdx.daso.sync`: what moves (blocking, non-blocking, merge, drain) and
  `hvdx.transport.ring`: how it moves between nodes without blocking Horovod's thread;
- `hvdx.daso.method.DASOMethod`: the method, whatever the Keras (an
  `hvdx.lifecycle.TrainingMethod`); `hvdx.daso.optimizer.DASO` (also `hvdx.DASO`): the Keras 2
  optimizer, which makes `hvdx.daso.keras3_optimizer.DASO` for a Keras 3 optimizer; `hvdx.daso.keras.DASOCallback` (reached here without
  importing Keras' callbacks until asked for) drives it in Model.fit.
"""
from hvdx.daso.method import DASOMethod, find_daso
from hvdx.daso.optimizer import DASO
from hvdx.daso.schedule import COOLDOWN, CYCLING, WARMUP, Action, Schedule
from hvdx.plateau import PlateauDetector

__all__ = ["COOLDOWN", "CYCLING", "DASO", "DASOCallback", "DASOMethod", "find_daso", "WARMUP", "Action", "PlateauDetector", "Schedule"]


def __getattr__(name: str):
    if name == "DASOCallback":  # its Keras glue (hvdx.daso.keras), imported when asked for
        from hvdx.daso.keras import DASOCallback
        return DASOCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
