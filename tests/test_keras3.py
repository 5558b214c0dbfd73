"""Keras 3 as tf.keras (TensorFlow 2.16+ without $TF_USE_LEGACY_KERAS; docs/keras3.md):
hvdx.init(), hvdx.DistributedGradientTape over a Keras 3 model's variables and
hvdx.broadcast_variables of its model and optimizer train it in a custom loop, and hvdx's
Keras entry points take Keras 3's objects. This test process has tf.keras as Keras 2
(tests/conftest.py), so the Keras 3 runs are fresh processes (tests/multirank/keras3_loop.py).
The unwrapping of Keras 3 variables (hvdx.variables) is checked on every stack."""
import json
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
from tests import harness, suite
from tests.harness import HAS_KERAS3

keras3 = harness.KERAS3
KERAS3_ENV = {legacy_keras.ENV: None}  # removed: tf.keras is TensorFlow's default, Keras 3


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
        env = {k: v for k, v in harness.test_env(out).items() if k != legacy_keras.ENV}
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


def assert_entry_points_take_keras3(entry_points: dict) -> None:
    assert entry_points == {"DistributedOptimizer": "hvdx.keras3_optimizer", "keras": "True", "load_model": "True"}


@keras3
def test_a_keras3_model_trains_with_the_tape_and_the_keras_entry_points_take_keras3():
    data = run_alone("allreduce", "hitopk")
    assert data["tf_keras_package"] == "keras" and data["keras"].startswith("3.")
    assert data["size"] == 1
    assert sorted(data["runs"]) == ["allreduce", "hitopk"]
    assert_trained(data["runs"])
    assert_entry_points_take_keras3(data["entry_points"])


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


KERAS3_USER = {"allreduce": ("allreduce", False), "hierarchical": ("hierarchical", False),
               "hitopk": ("hitopk", False), "sparse_allgather": ("sparse_allgather", False),
               "hitopk-mixed_float16": ("hitopk", True), "allreduce-mixed_float16": ("allreduce", True),
               "powersgd-mixed_float16": ("powersgd", True), "lowbit": ("lowbit", False)}


@suite.runs(*[suite.check("keras3_user.train_resume", "keras3:2x2", communication=communication,
                          mixed_precision=mixed, timeout=420) for communication, mixed in KERAS3_USER.values()
              if HAS_KERAS3], ids=list(KERAS3_USER) if HAS_KERAS3 else [])  # no launch where Keras 3 is absent
def test_a_keras3_users_job_trains_saves_and_resumes_on_two_nodes(ranks):
    """tests/multirank/check_keras3_user.py: `import keras` then `import hvdx.keras as hvd`, no
    environment variable; `fit` with Horovod's callbacks on 2 nodes x 2 ranks, each rank seeded
    apart; every rank saves a `.keras` checkpoint, `hvd.load_model` gives the wrapper back with
    its strategy and bitwise the same residuals and weights, and training goes on from it, the
    ranks bitwise identical throughout; the model classifies the digits."""
    assert sorted(ranks) == [0, 1, 2, 3]
    kwargs = dict(ranks.check.kwargs)
    lossy = kwargs["communication"] in ("hitopk", "sparse_allgather", "powersgd", "lowbit")
    mixed = kwargs["mixed_precision"]
    for rank, run in ranks.items():
        assert run["keras"].startswith("3."), run
        assert run["spread_before"] > 0.0 and run["spread"] == 0.0, (rank, run)
        assert run["same_weights"] and run["same_residuals"], (rank, run)
        assert (run["nonzero_residuals"] > 0) is lossy, (rank, run)  # error feedback kept, and restored
        assert run["loaded"]["module"] == "hvdx.keras3_optimizer", (rank, run)
        assert run["loaded"]["is_sgd"] is not mixed, (rank, run)  # under mixed_float16 it passes for the LSO
        assert run["compute_dtype"] == ("float16" if mixed else "float32"), (rank, run)
        assert run["lr"] == pytest.approx(run["initial_lr"]), (rank, run)  # the warm-up ended at the rate
        assert run["loss"][-1] < 0.5 * run["loss"][0], (rank, run)
        assert run["accuracy"] > 0.85, (rank, run)


KERAS3_METHODS = ("localsgd", "streaming4", "adpsgd", "assm", "passm")


@suite.runs(*[suite.check("keras3_methods.fit", "keras3:2x2", method=method, timeout=300)
              for method in KERAS3_METHODS if HAS_KERAS3], ids=list(KERAS3_METHODS) if HAS_KERAS3 else [])
def test_the_methods_beside_the_step_train_a_keras3_model_into_one_model_on_every_rank(ranks):
    """tests/multirank/check_keras3_methods.py: a Keras 3 model and optimizer, no environment
    variable, `fit` with the one method driver on 2 nodes x 2 ranks, each rank seeded apart on
    its own shard: LocalSGD (DiLoCo's outer optimizer, of Keras 3 by default there), streaming
    DiLoCo with 4-bit outer gradients, AD-PSGD, ASSM and PASSM (each node's processes on one
    shared model, their step in place of Keras 3's). Every rank ends with the same model bitwise,
    the model classifies the digits, and the method's state goes through JSON into a new one."""
    assert sorted(ranks) == [0, 1, 2, 3]
    method = dict(ranks.check.kwargs)["method"]
    for rank, run in ranks.items():
        assert run["keras"].startswith("3.") and run["model_keras"] == "keras", run
        assert run["spread"] == 0.0, (rank, run)
        assert run["loss"][-1] < run["loss"][0], (rank, run)  # (asynchronous: a rank may join a trained model)
        assert run["accuracy"] > 0.8, (rank, run)
        assert run["stats"]["steps"] > 0, (rank, run)
        if method in ("localsgd", "streaming4"):
            assert run["restored"] and run["outer_keras"] == "keras", (rank, run)
            assert run["stats"]["outer_steps"] > 0 and run["stats"]["pending"] == 0, (rank, run)
        elif method in ("assm", "passm"):
            assert run["restored"] and run["stats"]["staleness"]["updates"] == run["stats"]["steps"], (rank, run)


@suite.runs(*[suite.check("keras3_methods.daso", "keras3:2x2", timeout=300)] if HAS_KERAS3 else [])
def test_daso_trains_a_keras3_model_in_mixed_precision_saves_and_resumes(ranks):
    """tests/multirank/check_keras3_methods.py `daso`: hvdx.DASO around a Keras 3 SGD under the
    mixed_float16 policy on 2 nodes x 2 ranks, ranks seeded apart, one rank's batch overflowing:
    the Keras 3 DASO (an hvdx.daso.DASOMethod, its loss scaler inside) trains through blocking and
    non-blocking synchronisations, each fit closes its transport, every epoch ends with one model
    on every rank; the overflow lowers only its node's loss scale (node-local averaging); the
    `.keras` archive gives back the Keras 3 DASO with its schedule and weights, and a third fit
    goes on from it."""
    assert sorted(ranks) == [0, 1, 2, 3]
    scales = ranks[0]["loss_scales"]
    assert scales[0] == scales[1] and scales[2] == scales[3] and scales[1] < scales[2], scales
    for rank, run in ranks.items():
        assert run["keras"].startswith("3.") and run["type"] == "hvdx.daso.keras3_optimizer.DASO", run
        assert run["method"] and run["loss_scaled"] and run["compute_dtype"] == "float16", run
        assert run["spread_before_load"] == 0.0 and run["spread"] == 0.0, (rank, run)
        assert run["starts"] > 0 and run["blocking"] > 0, (rank, run)  # both kinds of synchronisation ran
        assert run["transports"] == {"first_closed": True, "second_closed": True, "new": True}, (rank, run)
        assert run["loaded_type"] == run["type"] and run["schedule_restored"] and run["weights_restored"], run
        assert run["epochs_after_load"] == 5, (rank, run)
        assert run["loss"][-1] < run["loss"][0] and run["accuracy"] > 0.85, (rank, run)
        assert run["accuracy_after_load"] > 0.85, (rank, run)
