"""Keras 3 as tf.keras (TensorFlow 2.16+, $TF_USE_LEGACY_KERAS=0; docs/keras3.md):
hvdx.init(), hvdx.DistributedGradientTape over a Keras 3 model's variables and
hvdx.broadcast_variables of its model and optimizer train it in a custom loop, and the Keras
integration fails with Keras3Error saying what to use instead. This test process has tf.keras
routed to tf_keras, so the Keras 3 runs are fresh processes (tests/multirank/keras3_loop.py).
The unwrapping of Keras 3 variables (hvdx.variables) is checked on every stack."""
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import tensorflow as tf

import hvdx
from hvdx import legacy_keras
from hvdx.aggregator import GradientAggregator
from hvdx.variables import tf_variable
from tests import harness

TF = tuple(int(p) for p in tf.__version__.split(".")[:2])
KERAS = importlib.metadata.version("keras")
keras3 = pytest.mark.skipif(
    TF < legacy_keras.KERAS3_SINCE or int(KERAS.split(".")[0]) < 3,
    reason=f"no Keras 3 to run: TensorFlow {tf.__version__} with the keras package {KERAS} (Keras 3 is tf.keras "
           f"from TensorFlow 2.16 on, the tf2.21 stack)")
KERAS3_ENV = {legacy_keras.ENV: "0"}


class Keras3Variable:
    """What the aggregator sees of a Keras 3 variable on the TensorFlow backend: no `ref()`,
    the tf.Variable it holds as `.value` (keras.src.backend.tensorflow.core.Variable)."""

    def __init__(self, variable: tf.Variable) -> None:
        self.value = variable


def test_tf_variable_is_the_variable_a_keras3_variable_holds():
    v = tf.Variable([1.0, 2.0])
    assert tf_variable(Keras3Variable(v)) is v
    t = tf.constant(1.0)
    assert tf_variable(v) is v and tf_variable(t) is t and tf_variable(None) is None


@pytest.fixture(scope="module")
def one_rank():
    return hvdx.init()


def test_the_aggregator_takes_keras3_variables_as_their_tf_variables(one_rank):
    """Groups, local sources and the record name the tf.Variable (Keras 3's have no ref())."""
    a, b, c = tf.Variable(tf.ones([3])), tf.Variable(tf.ones([2])), tf.Variable(tf.ones([4]))
    wrapped = [Keras3Variable(v) for v in (a, b, c)]
    aggregator = GradientAggregator("allreduce", groups=[[wrapped[0], wrapped[2]]])
    grads = [tf.fill([3], 2.0), tf.fill([2], 3.0), tf.fill([4], 4.0)]
    out = aggregator(grads, wrapped, local=[wrapped[1]])
    assert [g.numpy().tolist() for g in out] == [[2.0] * 3, [3.0] * 2, [4.0] * 4]
    record = aggregator.last_aggregation
    buckets = [[record.variables[p.index] for p in bucket.pieces] for bucket in record.buckets]
    assert len(buckets) == 1 and len(buckets[0]) == 2 and buckets[0][0] is a and buckets[0][1] is c


def run_alone(*communications: str) -> dict:
    """tests/multirank/keras3_loop.py in a fresh process with Keras 3 as tf.keras: one
    rank (Horovod of size 1). Returns its result."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(harness.test_env(out), **KERAS3_ENV)
        proc = subprocess.run([sys.executable, str(harness.MULTIRANK / "keras3_loop.py"), *communications],
                              cwd=harness.ROOT, env=env, capture_output=True, text=True, timeout=300)
        result = Path(out, "rank-0.json")
        assert result.exists(), proc.stderr[-3000:]
        data = json.loads(result.read_text())
    assert data["ok"], data.get("error")
    return data["data"]


def assert_trained(runs: dict) -> None:
    for communication, run in runs.items():
        assert run["last_loss"] < 0.25 * run["first_loss"], (communication, run)
        assert run["accuracy"] > 0.85, (communication, run)
        assert run["spread_after"] == 0.0, (communication, run)


def assert_unsupported_say_what_to_use(unsupported: dict) -> None:
    assert sorted(unsupported) == ["DistributedOptimizer", "callbacks", "keras", "load_model"]
    for name, message in unsupported.items():
        assert message.startswith("Keras3Error:"), (name, message)
        assert "Under Keras 3, use " + legacy_keras.KERAS3_NATIVE in message, (name, message)
        assert "set it to 1" in message, (name, message)  # how to get Keras 2 back


@keras3
def test_a_keras3_model_trains_with_the_tape_and_the_keras_integration_fails_clearly():
    data = run_alone("allreduce", "hitopk")
    assert data["tf_keras_package"] == "keras" and data["keras"].startswith("3.")
    assert data["size"] == 1
    assert sorted(data["runs"]) == ["allreduce", "hitopk"]
    assert_trained(data["runs"])
    assert_unsupported_say_what_to_use(data["unsupported"])


@keras3
def test_choosing_keras3_lets_tensorflow_be_imported_first():
    """$TF_USE_LEGACY_KERAS=0 is a choice: `import hvdx` after TensorFlow does not refuse it."""
    code = ("import tensorflow as tf\nimport hvdx\nfrom hvdx import legacy_keras\n"
            "print(legacy_keras.keras_package(tf), hvdx.init().size)")
    env = {k: v for k, v in os.environ.items() if k != legacy_keras.ENV}
    proc = subprocess.run([sys.executable, "-c", code], cwd=harness.ROOT, env=dict(env, TF_CPP_MIN_LOG_LEVEL="3",
                          **KERAS3_ENV), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["keras", "1"]


@keras3
@pytest.mark.multirank
def test_ranks_of_two_nodes_agree_and_learn_with_every_strategy():
    """2 nodes x 2 ranks: after hvdx.broadcast_variables the ranks' models (apart before, each
    seeded by its rank) stay identical under allreduce, 2DTAR and HiTopK, and learn."""
    job = harness.launch("keras3_loop.py", "allreduce", "hierarchical", "hitopk", np=4, hosts=harness.hosts(2, 2),
                         timeout=300, env=KERAS3_ENV)
    ranks = job.check()
    for rank, data in ranks.items():
        assert data["size"] == 4 and data["num_nodes"] == 2
        assert_trained(data["runs"])
        assert all(run["spread_before"] > 0 for run in data["runs"].values()), data["runs"]
