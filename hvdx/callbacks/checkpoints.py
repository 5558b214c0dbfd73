"""A run's checkpoints in `Model.fit`: every rank's after each epoch, the run's state file,
the old ones pruned (`hvdx.checkpoints`)."""
from __future__ import annotations

import os
from typing import Callable

import tensorflow as tf

from hvdx.checkpoints import EpochCheckpoints, write_json
from hvdx.topology import barrier
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["CheckpointCallback"]


class CheckpointCallback(keras2.callbacks.Callback):
    """After every epoch: every rank writes `checkpoint` (`checkpoints.write`); once all have,
    rank 0 writes `state(epoch, checkpoint name)` to `state_path` (`write_json`); once it
    has, every rank prunes its old checkpoints. Collective: two barriers per epoch."""

    def __init__(self, checkpoints: EpochCheckpoints, checkpoint: tf.train.Checkpoint, rank: int, state_path: str,
                 state: Callable[[int, str], dict]) -> None:
        super().__init__()
        self.checkpoints, self.checkpoint, self.rank = checkpoints, checkpoint, rank
        self.state_path, self.state = state_path, state

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        path = self.checkpoints.write(self.checkpoint, epoch + 1)
        barrier()
        if self.rank == 0:
            write_json(self.state_path, self.state(epoch, os.path.basename(path)))
        barrier()
        self.checkpoints.prune(epoch + 1)
