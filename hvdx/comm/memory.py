"""Error feedback (GRACE's "memory"): what a rank did not send, kept for its next step.

A residual belongs to one rank (it is that rank's unsent part of its own slice) and to the
variables whose gradients filled its buffer. Each residual therefore carries two small
companions, checkpointed with it:

- `owner` = (rank, size) of the rank that wrote it. A residual restored on another rank (a
  checkpoint saved on rank 0 only and restored everywhere, a broadcast) is read as zeros,
  with a warning when it held anything, and is overwritten at the next finite step: no
  rank ever applies another rank's residual.
- `scale` = the loss scale its gradients carried when it was written. With dynamic loss
  scaling in a custom loop the gradients are scaled; when the scale changes, the residual
  is rescaled before it is added to the next buffer.

A residual of a sparse strategy also has a step counter (`counter`), which seeds MSTopK's
window (`hvdx.ops.stateless_mstopk`: a resumed run selects what the uninterrupted one would
have) and sets the density warm-up's stage (`hvdx.comm.dgc`): it is the same on every rank
(the ranks of a new membership take the largest at their first call,
`hvdx.comm.sparse.TopKStrategy.agree_state`), so it is not gated by `owner` (a checkpoint
saved on rank 0 restores it everywhere, and all ranks stay in the same stage).

Writes are two-phase: a strategy returns the new residuals as updates, and `commit` makes
them only when the step's averaged gradients are finite, identically on every rank (they
all see the same averaged gradients). A skipped step leaves every residual as it was.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

__all__ = ["ResidualMemory", "commit"]

Update = Tuple[tf.Variable, tf.Tensor]


def commit(updates: Sequence[Update], finite: tf.Tensor) -> tf.Operation:
    """Makes every (variable, value) write of `updates` if `finite`, none otherwise."""
    updates = list(updates)
    if not updates:
        return tf.no_op()

    def write():
        return tf.group(*[variable.assign(value, read_value=False) for variable, value in updates])

    return tf.cond(finite, write, tf.no_op)


class ResidualMemory(tf.Module):
    """One residual per buffer name, created on first use with its owner and scale.

    Args:
      owner: the name of the strategy (or part) that keeps it: the variables' prefix.
      shared: the state is the same on every rank (PowerSGD's warm-started Q, the result of an
        all-reduce), not one rank's own: `read` returns it whoever wrote it (a checkpoint saved
        on rank 0 restores it everywhere), and it is not rescaled with the loss scale.
    """

    def __init__(self, owner: str, shared: bool = False) -> None:
        super().__init__(name=f"{owner}_memory")
        self._owner_name = owner
        self.shared = shared
        self._residuals: Dict[str, tf.Variable] = {}
        self._owners: Dict[str, tf.Variable] = {}
        self._scales: Dict[str, tf.Variable] = {}
        self._counters: Dict[str, tf.Variable] = {}
        self._pending_counters: Dict[str, int] = {}
        self._pending: Dict[str, Tuple[np.ndarray, np.ndarray, float]] = {}

    @staticmethod
    def _me() -> np.ndarray:
        from hvdx.topology import topology

        topo = topology()
        return np.array([topo.rank, topo.size], np.int32)

    def variable(self, name: str, length: int, dtype: tf.DType = tf.float32) -> tf.Variable:
        """The residual of buffer `name`, created (zeros, owned by this rank) if new, or made
        again (zeros, with a warning on stderr naming it) when the layout now needs another
        length: a new membership (Elastic Horovod's reset, nodes that run flat) slices the
        buffer differently, and a residual of the old slices is never applied to the new."""
        residual = self._residuals.get(name)
        if residual is not None and residual.shape[0] != length:
            sys.stderr.write(f"hvdx warning: the {self._owner_name} residual {name!r} held {residual.shape[0]} "
                             f"elements and the layout now needs {length} (the ranks or nodes changed); it starts "
                             "from zero\n")
            self._residuals.pop(name)
            residual = None
        if residual is None:
            value, owner, scale = np.zeros([length], dtype.as_numpy_dtype), self._me(), 1.0
            pending = self._pending.pop(name, None)
            if pending is not None and pending[0].shape == (length,):
                value, owner, scale = pending[0].astype(dtype.as_numpy_dtype), pending[1], pending[2]
            with tf.init_scope():  # variables, also when first called inside tf.function
                prefix = f"hvdx_{self._owner_name}_{name}"
                residual = tf.Variable(value, trainable=False, name=f"{prefix}_residual")
                self._owners[name] = tf.Variable(owner, trainable=False, name=f"{prefix}_owner")
                self._scales[name] = tf.Variable(scale, dtype=tf.float32, trainable=False, name=f"{prefix}_scale")
            self._residuals[name] = residual
        return residual

    def counter(self, name: str) -> tf.Variable:
        """The step counter of buffer `name` (int64, created at 0 if new): how many finite
        steps the buffer was aggregated in. Shared by all ranks, not gated by `owner`."""
        counter = self._counters.get(name)
        if counter is None:
            with tf.init_scope():
                counter = tf.Variable(self._pending_counters.pop(name, 0), dtype=tf.int64, trainable=False,
                                      name=f"hvdx_{self._owner_name}_{name}_step")
            self._counters[name] = counter
        return counter

    def agree_counters(self, names: Sequence[str], process_set, collective: str) -> None:
        """Sets the step counter of each buffer of `names` to its largest value over the ranks
        of `process_set`: one eager all-reduce named `collective` (also while a step is traced)."""
        counters = [self.counter(name) for name in names]
        if not counters:
            return
        with tf.init_scope():
            steps = tf.stack([counter.read_value() for counter in counters])
            agreed = hvd.allreduce(steps, op=hvd.Max, process_set=process_set, name=collective).numpy()
            for counter, step in zip(counters, agreed):
                counter.assign(int(step))

    def read(self, name: str, length: int, dtype: tf.DType, loss_scale: Optional[tf.Tensor] = None) -> tf.Tensor:
        """The residual to add to this step's buffer: zeros if another rank wrote it, and
        rescaled to `loss_scale` if it was written under another one (neither when `shared`)."""
        residual = self.variable(name, length, dtype)
        if self.shared:
            return residual.read_value()
        owner = self._owners[name]
        me = tf.constant(self._me())

        def foreign():
            held = tf.reduce_any(tf.not_equal(residual, 0))
            warn = tf.cond(held, lambda: tf.print(
                "hvdx warning: the error-feedback residual", name, "was written by rank", owner[0], "of",
                owner[1], "(a checkpoint saved on another rank, or a broadcast); rank", me[0],
                "starts this residual from zero.", output_stream=sys.stderr), tf.no_op)
            with tf.control_dependencies([warn]):
                return tf.zeros_like(residual)

        value = tf.cond(tf.reduce_all(tf.equal(owner, me)), residual.read_value, foreign)
        if loss_scale is None:
            return value
        factor = tf.cast(loss_scale, tf.float32) / self._scales[name]
        return tf.cond(tf.equal(factor, 1.0), lambda: value, lambda: value * tf.cast(factor, value.dtype))

    def updates(self, name: str, value: tf.Tensor, loss_scale: Optional[tf.Tensor] = None) -> List[Update]:
        """The writes that make `value` this rank's residual of buffer `name`."""
        writes = [(self._residuals[name], value), (self._owners[name], tf.constant(self._me()))]
        if loss_scale is not None:
            writes.append((self._scales[name], tf.cast(loss_scale, tf.float32)))
        return writes

    # -- saving where tf.train.Checkpoint does not reach (Keras' .keras format) ---------
    def state(self) -> Dict[str, np.ndarray]:
        """Every residual with its owner and scale, as arrays keyed '<name>.<what>'."""
        out = {}
        for name, residual in self._residuals.items():
            out[f"{name}.residual"] = residual.numpy()
            out[f"{name}.owner"] = self._owners[name].numpy()
            out[f"{name}.scale"] = np.asarray(self._scales[name].numpy())
        for name, counter in self._counters.items():
            out[f"{name}.step"] = np.asarray(counter.numpy())
        return out

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        """Loads what `state()` saved; residuals not created yet get it when they are."""
        for key in [key for key in state if key.endswith(".step")]:
            name, step = key[:-len(".step")], int(np.asarray(state[key]))
            if name in self._counters:
                self._counters[name].assign(step)
            else:
                self._pending_counters[name] = step
        names = {key.rsplit(".", 1)[0] for key in state if not key.endswith(".step")}
        for name in names:
            value, owner = np.asarray(state[f"{name}.residual"]), np.asarray(state[f"{name}.owner"], np.int32)
            scale = float(np.asarray(state[f"{name}.scale"]))
            if name in self._residuals:
                if tuple(self._residuals[name].shape) != value.shape:
                    raise ValueError(f"residual {name!r} has {tuple(self._residuals[name].shape)} elements here "
                                     f"but {value.shape} in the saved state (saved with another topology?)")
                self._residuals[name].assign(value)
                self._owners[name].assign(owner)
                self._scales[name].assign(scale)
            else:
                self._pending[name] = (value, owner, scale)

    @property
    def variables_by_name(self) -> Dict[str, tf.Variable]:
        return dict(self._residuals)
