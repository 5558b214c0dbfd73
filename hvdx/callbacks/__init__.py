"""Keras callbacks for hvdx training, one module per concern:

- `broadcast.py`: `BroadcastGlobalVariablesCallback` (Horovod's, plus a check before the
  first batch that every rank runs as many steps and epochs: `check_same_steps`);
- `communication.py`: `SwitchCommunication` / `switch` (the aggregation strategy at an
  epoch) and `CommunicationPolicy` (dense -> HiTopK -> 2DTAR at epochs or on a plateau);
- `method.py`: `TrainingMethodCallback`, the one driver of every `hvdx.lifecycle.TrainingMethod`
  (DASO, AD-PSGD, the shared-memory family, LocalSGD, streaming DiLoCo), knowing none of them
  (a method's own subclass lives in its package: `hvdx.daso.DASOCallback`,
  `hvdx.adpsgd.ADPSGDCallback`, `hvdx.asynchronous.SharedModelCallback`);
- `phased.py`: `EpochTimer` (each epoch's training time) and `EpochLog` (each epoch's phase,
  strategy, rate, throughput and metrics) of a phased run (`hvdx.phases`);
- `checkpoints.py`: `CheckpointCallback` (every rank's checkpoint after each epoch, the run's
  state, the old ones pruned: `hvdx.checkpoints`).

Horovod's other callbacks work unchanged with hvdx's optimizer (`hvdx.keras.callbacks` holds
them all).
"""
from hvdx.callbacks.broadcast import BroadcastGlobalVariablesCallback, check_same_steps
from hvdx.callbacks.checkpoints import CheckpointCallback
from hvdx.callbacks.communication import CommunicationPolicy, Phase, SwitchCommunication, switch
from hvdx.callbacks.method import TrainingMethodCallback
from hvdx.callbacks.phased import EpochLog, EpochTimer

__all__ = ["BroadcastGlobalVariablesCallback", "CheckpointCallback", "CommunicationPolicy", "EpochLog", "EpochTimer",
           "Phase", "SwitchCommunication", "TrainingMethodCallback", "check_same_steps", "switch"]
