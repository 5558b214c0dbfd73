"""The DAWNBench recipe (examples/dawnbench.py, shi2021 sec. 5.6) on an m x n job, every rank:
its smoke preset (tiny ResNet, 2 short phases, synthetic data) run three times through the
script's main(), as a user runs it:

1. uninterrupted, 3 epochs, keeping the newest 2 checkpoints, then Table 4's 1-rank
   throughput (`--se-steps 2`);
2. stopped after epoch 1 (a pre-emption: the checkpoint holds HiTopK's residuals);
3. resumed from that checkpoint to the end, keeping the newest 2.

Returns, per run, what every epoch trained with (phase, resolution, batch, strategy), how
the resumed run's checkpoint and final weights compare with the uninterrupted run's
(`check_resume`), which checkpoints each run kept, and the uninterrupted run's per-phase
throughput and scaling efficiency. tests/test_dawnbench.py asserts.
"""
import importlib.util
import os
import shutil
import sys
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdx
from hvdx.checkpoints import EpochCheckpoints
from hvdx.legacy_keras import tf_keras_is_keras3

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "dawnbench.py")


def load_script():
    """examples/dawnbench.py as the module `dawnbench` (loaded once per process), for its main()."""
    if "dawnbench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dawnbench", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["dawnbench"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["dawnbench"]


def epochs_of(summary: dict) -> list:
    return [{k: h[k] for k in ("epoch", "phase", "resolution", "batch_size", "communication", "steps")}
            for h in summary["history"]]


def residual_norms(checkpoint: str) -> dict:
    """The error-feedback residuals a checkpoint holds: {variable path: L2 norm}."""
    reader = tf.train.load_checkpoint(checkpoint)
    return {name: float(np.linalg.norm(reader.get_tensor(name)))
            for name in reader.get_variable_to_shape_map() if "residual" in name and "OPTIMIZER_SLOT" not in name}


def checkpoint_differences(a: str, b: str) -> list:
    """The variables (weights, LARS' momenta, residuals, step counters) whose values differ
    between two checkpoints, or that only one of them holds."""
    ra, rb = tf.train.load_checkpoint(a), tf.train.load_checkpoint(b)
    names = {n for n in ra.get_variable_to_shape_map() if not n.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")}
    other = {n for n in rb.get_variable_to_shape_map() if not n.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")}
    return sorted(names ^ other) + sorted(n for n in names & other
                                         if not np.array_equal(ra.get_tensor(n), rb.get_tensor(n)))


def relative_difference(a: list, b: list) -> float:
    """||a - b|| / ||a|| over all the tensors together."""
    diff = sum(float(np.sum(np.square(np.asarray(x, np.float64) - y))) for x, y in zip(a, b))
    return float(np.sqrt(diff / max(sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in a), 1e-30)))


def check_resume(topo, phases: str = "2x8@4,1x12@2", switch_epoch: int = 2, steps: int = 2) -> dict:
    """Returns, besides the runs' epochs: `checkpoint_differences`, what differs between the
    uninterrupted and the resumed run's checkpoints after epoch 2 (the last HiTopK epoch, one
    trained after the resume: all-gathers summed in rank order, bit for bit reproducible);
    `weights_equal` / `unequal_weights` / `weights_relative_difference` for the final weights,
    after the 2DTAR epoch (Horovod's fused allreduce of more than two ranks sums in an order
    that depends on what its cycle fused, so equal to rounding, not bits); and
    `last_epoch_relative_change`, how much the last epoch moved the weights (the scale a lost
    piece of state would show at)."""
    script = load_script()
    out = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvdx-dawnbench-") if topo.rank == 0 else None,
                               root_rank=0, name="check.dawnbench.tmp")
    flags = ["--preset", "smoke", "--phases", phases, "--switch-epoch", str(switch_epoch), "--verbose", "0",
             "--synthetic-steps", str(steps), "--no-plot", "--no-comm-timing"]

    def run(name: str, *extra: str) -> dict:
        return script.main(flags + ["--out", os.path.join(out, name), *extra])

    def checkpoints(name: str) -> EpochCheckpoints:
        return EpochCheckpoints(os.path.join(out, name, "checkpoints", f"rank{topo.rank}"))

    def checkpoint(name: str, epoch: int) -> str:
        return checkpoints(name).path(epoch)

    try:
        # and Table 4's SE (after training: the weights are unchanged); the newest 2 checkpoints kept
        full = run("full", "--se-steps", "2", "--keep-checkpoints", "2")
        stopped = run("resumed", "--stop-after", "1")
        kept_after_stop = checkpoints("resumed").saved()
        residuals = residual_norms(checkpoint("resumed", 1))
        resumed = run("resumed", "--resume", "--keep-checkpoints", "2")
        kept = {"full": checkpoints("full").saved(), "stopped": kept_after_stop,
                "resumed": checkpoints("resumed").saved()}
        same = [bool(np.array_equal(a, b)) for a, b in zip(full["weights"], resumed["weights"])]
        before, after = (tf.train.load_checkpoint(checkpoint("full", e)) for e in (switch_epoch, switch_epoch + 1))
        model_variables = sorted(n for n in before.get_variable_to_shape_map() if n.startswith("model/"))
        last_change = relative_difference([after.get_tensor(n) for n in model_variables],
                                          [before.get_tensor(n) for n in model_variables])
        return {"full": epochs_of(full), "stopped": epochs_of(stopped), "resumed": epochs_of(resumed),
                "checkpoint_differences": checkpoint_differences(checkpoint("full", switch_epoch),
                                                                 checkpoint("resumed", switch_epoch)),
                "weights_equal": all(same) and len(full["weights"]) == len(resumed["weights"]),
                "unequal_weights": same.count(False),
                "weights_relative_difference": relative_difference(full["weights"], resumed["weights"]),
                "last_epoch_relative_change": last_change,
                "residuals_at_checkpoint": residuals,
                "checkpoints_kept": kept,
                "phases": [{k: p[k] for k in ("phase", "samples_per_s", "single_samples_per_s", "scaling_efficiency")}
                           for p in full["phases"]],
                "trainable_norm": float(sum(np.sum(np.square(w)) for w in full["trainable_weights"])),
                "keras": "3" if tf_keras_is_keras3() else "2"}
    finally:
        hvdx.barrier()
        if topo.rank == 0:
            shutil.rmtree(out, ignore_errors=True)


CHECKS = {"resume": check_resume}
