"""A training run's checkpoints: after every epoch each rank writes its own
`tf.train.Checkpoint` (`<directory>/epoch<N>`, N = epochs done), the newest `keep` of them
are kept, and rank 0 writes the run's state (a JSON file naming the newest checkpoint)
that a resumed run starts from.

Per rank, because part of the state is each rank's own (hvdx's error-feedback residuals,
docs/comm.md). The order after an epoch makes a stop at any moment resumable: every rank
writes epoch N, then rank 0 writes the state naming N, then every rank removes the old ones.

    checkpoints = EpochCheckpoints(os.path.join(out, "checkpoints", f"rank{rank}"), keep=3)
    model.fit(..., callbacks=[hvdx.callbacks.CheckpointCallback(checkpoints, tf.train.Checkpoint(model=model,
              optimizer=model.optimizer), rank, os.path.join(out, "state.json"), state)])
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, List, Optional

import tensorflow as tf


__all__ = ["EpochCheckpoints", "read_state", "write_json"]


def write_json(path: str, obj: Any) -> None:
    """Writes `obj` as JSON to `path` atomically (a reader sees the old file or the new)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def read_state(path: str) -> dict:
    """The run's state file written by `CheckpointCallback`.

    Raises:
        FileNotFoundError: there is none (saying to start the run without resuming first).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {path} to resume from: run without --resume first, or give the --out "
                                f"of the run to continue")
    with open(path) as f:
        return json.load(f)


class EpochCheckpoints:
    """One rank's checkpoints in `directory`, `epoch<N>` after N epochs, the newest `keep`
    kept (0: all).

    Raises:
        ValueError: a negative `keep`.
    """

    _NAME = re.compile(r"^epoch(\d+)\.index$")

    def __init__(self, directory: str, keep: int = 3) -> None:
        if keep < 0:
            raise ValueError(f"keep {keep} checkpoints: give the number of the newest to keep, or 0 for all")
        self.directory, self.keep = directory, keep

    def path(self, epochs: int) -> str:
        """The checkpoint prefix after `epochs` epochs."""
        return os.path.join(self.directory, f"epoch{epochs}")

    def saved(self) -> List[int]:
        """The epochs (ascending) that have a complete checkpoint here (its index written)."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(m.group(1)) for m in map(self._NAME.match, os.listdir(self.directory)) if m)

    def newest(self) -> Optional[str]:
        """The newest checkpoint's prefix, or None."""
        saved = self.saved()
        return self.path(saved[-1]) if saved else None

    def write(self, checkpoint: tf.train.Checkpoint, epochs: int) -> str:
        """Writes `checkpoint` as the one after `epochs` epochs; returns its prefix."""
        return checkpoint.write(self.path(epochs))

    def prune(self, newest: int) -> List[int]:
        """Removes the checkpoints but the `keep` newest up to epoch `newest` (the one just
        written), and any numbered above `newest` (left by an earlier run into the same
        directory: they are not this run's); nothing if `keep` is 0. Returns the epochs
        removed."""
        if self.keep == 0:
            return []
        kept = [e for e in self.saved() if e <= newest][-self.keep:]
        removed = [e for e in self.saved() if e not in kept]
        for epoch in removed:
            prefix = self.path(epoch)
            os.remove(f"{prefix}.index")  # first: a checkpoint without its index is not listed
            for data in glob.glob(glob.escape(prefix) + ".data-*"):
                os.remove(data)
        return removed
