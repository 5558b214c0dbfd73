"""The DAWNBench recipe (examples/dawnbench.py, shi2021 sec. 5.6) on an m x n job, every rank:
its smoke preset (tiny ResNet, 2 short phases, synthetic data) three times:

1. uninterrupted, 3 epochs, then Table 4's 1-rank throughput (`--se-steps 2`);
2. stopped after epoch 1 (a pre-emption: the checkpoint holds HiTopK's residuals);
3. resumed from that checkpoint to the end.

Returns, per run, what every epoch trained with (phase, resolution, batch, strategy),
whether the resumed run's final weights equal the uninterrupted run's bit for bit, and the
uninterrupted run's per-phase throughput and scaling efficiency.
tests/test_dawnbench.py asserts.
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

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "dawnbench.py")


def load_script():
    """examples/dawnbench.py as the module `dawnbench` (loaded once per process)."""
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


def check_resume(topo, phases: str = "2x8@4,1x12@2", switch_epoch: int = 2, steps: int = 2) -> dict:
    script = load_script()
    out = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvdx-dawnbench-") if topo.rank == 0 else None,
                               root_rank=0, name="check.dawnbench.tmp")
    flags = ["--preset", "smoke", "--phases", phases, "--switch-epoch", str(switch_epoch), "--verbose", "0"]

    def run(name: str, *extra: str) -> dict:
        config = script.make_config(flags + ["--out", os.path.join(out, name), *extra])
        config.synthetic_steps, config.plot, config.comm_timing = steps, False, False
        return script.train(config)

    try:
        full = run("full", "--se-steps", "2")  # and Table 4's SE (after training: the weights are unchanged)
        stopped = run("resumed", "--stop-after", "1")
        residuals = residual_norms(os.path.join(out, "resumed", "checkpoints", f"rank{topo.rank}", "epoch1"))
        resumed = run("resumed", "--resume")
        same = [bool(np.array_equal(a, b)) for a, b in zip(full["weights"], resumed["weights"])]
        return {"full": epochs_of(full), "stopped": epochs_of(stopped), "resumed": epochs_of(resumed),
                "weights_equal": all(same) and len(full["weights"]) == len(resumed["weights"]),
                "unequal_weights": same.count(False), "residuals_at_checkpoint": residuals,
                "phases": [{k: p[k] for k in ("phase", "samples_per_s", "single_samples_per_s", "scaling_efficiency")}
                           for p in full["phases"]],
                "trainable_norm": float(sum(np.sum(np.square(w)) for w in full["trainable_weights"]))}
    finally:
        hvdx.barrier()
        if topo.rank == 0:
            shutil.rmtree(out, ignore_errors=True)


CHECKS = {"resume": check_resume}
