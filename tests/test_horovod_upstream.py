"""Horovod's own code runs with hvdx's classes in place of Horovod's.

tests/upstream/horovod/ holds Horovod v0.28.1's TF2 example scripts and its Keras
optimizer tests, unmodified (Apache 2.0, see LICENSE there). Each test below writes an
adapted copy into a temporary directory, changing only what `ADAPTATIONS` lists: the
import of Horovod's API becomes hvdx's (`hvdx.keras` / `hvdx.tensorflow`), MNIST (a
download) becomes scikit-learn's bundled digits, and the examples train for a few steps
instead of thousands. Every listed change must apply exactly once.

The scripts run with dense averaging (hvdx's default) on 2 nodes x 1 rank, and with HiTopK
($HVDX_COMMUNICATION=hitopk) on 2 nodes x 2 ranks: at density 0.01 where a test asserts no
exact numbers, at density 1.0 where it does (gradient sums checked to the last digit).
"""
import shutil
from pathlib import Path

import pytest

from tests import harness

pytestmark = pytest.mark.multirank

UPSTREAM = Path(__file__).resolve().parent / "upstream"
HVDX_KERAS = ("import horovod.tensorflow.keras as hvd", "import hvdx.keras as hvd")
MNIST = ("tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", "digits_as_mnist.load_data()")
DIGITS_IMPORT = ("import tensorflow as tf\n", "import tensorflow as tf\nimport digits_as_mnist\n")

ADAPTATIONS = {
    "test_tensorflow2_keras.py": [HVDX_KERAS, ("import horovod.keras as hvd_keras", "import hvdx.keras as hvd_keras")],
    "tensorflow2_keras_mnist.py": [HVDX_KERAS, MNIST, DIGITS_IMPORT,
                                   ("steps_per_epoch=500 // hvd.size()", "steps_per_epoch=8 // hvd.size()"),
                                   ("callbacks=callbacks, epochs=24", "callbacks=callbacks, epochs=3")],
    "tensorflow2_mnist.py": [("import horovod.tensorflow as hvd", "import hvdx.tensorflow as hvd"), MNIST,
                             DIGITS_IMPORT, ("dataset.take(10000 // hvd.size())", "dataset.take(16 // hvd.size())")],
    "tensorflow2_keras_synthetic_benchmark.py": [HVDX_KERAS],
    "tensorflow2_synthetic_benchmark.py": [("import horovod.tensorflow as hvd", "import hvdx.tensorflow as hvd")],
}
# The synthetic benchmarks' own flags: a small model and a few batches on the CPU.
SYNTHETIC_ARGS = ["--model", "MobileNetV2", "--batch-size", "2", "--num-batches-per-iter", "1", "--num-iters", "2",
                  "--no-cuda"]
# Tests of test_tensorflow2_keras.py that check gradient values exactly: HiTopK at density 1.
EXACT = "test_gradient_aggregation or test_partial_distributed_optimizer"
# tf.test.TestCase's own deprecated test_session, which TensorFlow always skips: not Horovod's.
TF_SKIP = "test_session"
DENSE = {"HVDX_COMMUNICATION": "allreduce"}
HITOPK = {"HVDX_COMMUNICATION": "hitopk"}


def adapt(name: str, into: Path) -> Path:
    """The adapted copy of tests/upstream/horovod/<name> in `into` (with the digits helper)."""
    text = (UPSTREAM / "horovod" / name).read_text()
    for old, new in ADAPTATIONS[name]:
        assert text.count(old) == 1, f"{name}: expected {old!r} once, found it {text.count(old)} times"
        text = text.replace(old, new)
    shutil.copy(UPSTREAM / "digits_as_mnist.py", into / "digits_as_mnist.py")
    path = into / name
    path.write_text(text)
    return path


def test_adaptations_change_only_imports_data_and_length(tmp_path):
    """Undoing the listed changes gives Horovod's files back, byte for byte."""
    for name in ADAPTATIONS:
        text = adapt(name, tmp_path).read_text()
        for old, new in reversed(ADAPTATIONS[name]):
            text = text.replace(new, old)
        assert text == (UPSTREAM / "horovod" / name).read_text(), name


@pytest.mark.parametrize("topology,env,phases", [
    ((2, 1), DENSE, [f"not {TF_SKIP}", ""]),
    ((2, 2), HITOPK, [f"not ({EXACT} or {TF_SKIP})", "0.01", EXACT, "1.0"]),
], ids=["dense-2x1", "hitopk-2x2"])
def test_horovods_keras_tests_pass_with_hvdx(tmp_path, topology, env, phases):
    path = adapt("test_tensorflow2_keras.py", tmp_path)
    nodes, per_node = topology
    job = harness.launch("run_upstream.py", "pytest", str(path), *phases, np=nodes * per_node,
                         hosts=harness.hosts(nodes, per_node), timeout=600, env=env)
    data = job.check()
    for rank, phases_run in data.items():
        for phase, result in phases_run.items():
            failed = {t: o for t, o in result["outcomes"].items() if o != "passed"}
            assert result["exit"] == 0 and not failed, (rank, phase, failed, job.rank_output(rank, 60))
            assert result["outcomes"], (rank, phase, "no test ran")
    counted = sum(len(r["outcomes"]) for r in data[0].values())
    assert counted == 13, f"Horovod's file has 13 tests, {counted} ran"


@pytest.mark.parametrize("name,args", [
    ("tensorflow2_keras_mnist.py", []), ("tensorflow2_mnist.py", []),
    ("tensorflow2_keras_synthetic_benchmark.py", SYNTHETIC_ARGS + ["--fp16-allreduce"]),
    ("tensorflow2_synthetic_benchmark.py", SYNTHETIC_ARGS + ["--num-warmup-batches", "1"]),
])
@pytest.mark.parametrize("env", [DENSE, HITOPK], ids=["dense", "hitopk"])
def test_horovods_examples_run_with_hvdx(tmp_path, name, args, env):
    path = adapt(name, tmp_path)
    job = harness.launch("run_upstream.py", "script", str(path), *args, np=2, hosts=harness.hosts(2, 1),
                         timeout=300, env=env)
    job.check()
