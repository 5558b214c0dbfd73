"""The start of synchronous training in `Model.fit`: Horovod's broadcast of the initial state,
after a check that every rank runs as many steps and epochs (otherwise the rank with more
steps waits for ever in a collective the others never issue); a Keras 3 model's by
hvdx.keras.keras3_callbacks (`hvdx.callbacks.follow`).
"""
from __future__ import annotations

import horovod.tensorflow.keras.callbacks as hvd_callbacks

from hvdx.agreement import check_agreement
from hvdx.callbacks.follow import follows

__all__ = ["BroadcastGlobalVariablesCallback", "check_same_steps"]


def check_same_steps(params: dict, name: str = "hvdx.steps") -> None:
    """Collective: RankMismatchError on every rank unless all run as many steps per epoch
    and epochs (Keras' callback params)."""
    description = {"steps per epoch": str(params.get("steps")), "epochs": str(params.get("epochs"))}
    check_agreement(description, "how long they train (give every rank an equally long shard, or the same "
                                 "steps_per_epoch)", name)


class _HorovodsBroadcast(hvd_callbacks.BroadcastGlobalVariablesCallback):
    """Horovod's broadcast of the initial state from `root_rank`, after checking that every
    rank runs the same number of steps (fails on every rank, naming them, if not)."""

    def on_train_begin(self, logs=None) -> None:
        check_same_steps(self.params or {})


#: The broadcast of the initial state: Horovod's, after the steps' check, for a Keras 2 model;
#: hvdx.keras.keras3_callbacks' for a Keras 3 one (`hvdx.callbacks.follow`).
BroadcastGlobalVariablesCallback = follows(_HorovodsBroadcast,
                                           "hvdx.keras.keras3_callbacks:BroadcastGlobalVariablesCallback",
                                           hooks=("on_train_begin", "on_train_batch_end"))
