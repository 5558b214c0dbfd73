"""hvdx.elastic in one process: Horovod's elastic API through hvdx's namespaces, a reset that
rebuilds hvdx's topology and drops the traced Keras step, a clear error under MPI, and
residuals written under another membership read as zeros.

The elastic launches (2x2 -> 2 or 3 ranks under horovodrun's host discovery: a removed node,
a node that loses a rank, a SIGKILLed rank; HiTopK and the training methods) run
tests/multirank/elastic_digits.py (docs/elastic.md).
"""
import os

import numpy as np
import pytest
import tensorflow as tf

import hvdx
import hvdx.keras
import hvdx.tensorflow
from hvdx import elastic
from hvdx.topology import reinit, topology
from hvdx.comm.memory import ResidualMemory
from hvdx.zoo import mlp
from tests import harness


KERAS3_ONLY = harness.KERAS3


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvdx.init()


def test_hvd_elastic_is_hvdx_elastic_in_both_namespaces():
    assert hvdx.keras.elastic is elastic and hvdx.tensorflow.elastic is elastic
    for name in ("run", "KerasState", "TensorFlowKerasState", "TensorFlowState", "CommitStateCallback",
                 "UpdateBatchStateCallback", "UpdateEpochStateCallback", "ObjectState", "State"):
        assert hasattr(elastic, name), name


def test_reinit_builds_a_new_topology_for_the_current_ranks():
    before = topology()
    after = reinit()
    assert after is topology() and after is not before
    assert (after.rank, after.size, after.node_ranks) == (before.rank, before.size, before.node_ranks)


def test_a_keras_state_reset_rebuilds_the_topology_and_drops_the_traced_step():
    model = mlp(64, (8,), seed=0)
    model.compile(optimizer=hvdx.keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.zeros([4, 64], np.float32), np.zeros([4], np.int64)
    model.fit(x, y, epochs=1, verbose=0)
    assert model.train_function is not None
    state = elastic.KerasState(model, epoch=0)
    before = topology()
    state.reset()
    assert model.train_function is None and topology() is not before
    model.fit(x, y, epochs=1, verbose=0)  # traced again, for the new topology


def test_a_reset_forgets_the_layouts_the_old_ranks_agreed_on():
    """Layouts agreed by the ranks of the old membership are checked again by the new ones."""
    strategy = hvdx.comm.Allreduce()
    strategy.agree("grads", [3, 4], tf.float32)
    assert ("grads", (3, 4), "float32", None) in strategy._agreed_layouts()
    reinit()
    assert not strategy._agreed_layouts()
    strategy.agree("grads", [3, 4], tf.float32)
    assert ("grads", (3, 4), "float32", None) in strategy._agreed_layouts()


def test_a_reset_points_the_aggregation_at_the_new_process_set():
    """After Elastic Horovod's re-init an old process set's id means nothing: DASO's reset
    makes its node-local average (and every strategy that takes a process set) use the new
    topology's set, and a later switch builds with it."""
    import horovod.tensorflow as hvd

    from hvdx.aggregator import GradientAggregator

    aggregator = GradientAggregator("allreduce")
    new = hvd.ProcessSet([0])  # as reinit() makes them: a new object for the node's ranks
    aggregator.use_process_set(new)
    assert aggregator.process_set is new and aggregator.strategy.process_set is new
    assert aggregator.choice.horovod["process_set"] is new
    aggregator.use_process_set(hvd.global_process_set)  # a node that is now the whole world
    assert aggregator.strategy.process_set is hvd.global_process_set
    assert "process_set" not in aggregator.choice.horovod


@pytest.mark.parametrize("legacy", [False, pytest.param(True, marks=pytest.mark.keras2)])  # Keras 2's legacy ones
def test_a_sync_first_builds_the_optimizer_as_training_would(legacy):
    """A process Elastic Horovod adds never trained, and Keras creates an optimizer's slots at
    its first update: hvdx's states build them before Horovod's sync, so that it broadcasts as
    many optimizer variables as the ranks that trained (else the job hangs)."""
    from hvdx.variables import build_optimizer

    def compiled():
        model = mlp(64, (8,), seed=0)
        sgd = (tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD)(0.1, momentum=0.9)
        model.compile(optimizer=hvdx.keras.DistributedOptimizer(sgd, communication="hitopk"),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.build((None, 64))
        return model

    trained, added = compiled(), compiled()
    trained.fit(np.zeros([4, 64], np.float32), np.zeros([4], np.int64), epochs=1, verbose=0)
    build_optimizer(added.optimizer, added.trainable_variables)
    build_optimizer(added.optimizer, added.trainable_variables)  # idempotent
    def shapes(model):
        variables = model.optimizer.variables  # a method of Keras 2's legacy optimizers
        return [tuple(v.shape) for v in (variables() if callable(variables) else variables)]

    assert shapes(added) == shapes(trained) and len(shapes(added)) > 1


def test_a_reset_makes_the_ranks_check_the_steps_layout_again():
    """The aggregator checks a step's layout once per membership: after a reset the surviving
    ranks check again, as a process added by the reset does at its first trace."""
    model = mlp(64, (8,), seed=0)
    model.compile(optimizer=hvdx.keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.zeros([4, 64], np.float32), np.zeros([4], np.int64)
    model.fit(x, y, epochs=1, verbose=0)
    aggregator = model.optimizer._aggregator
    checks = aggregator._book.checks
    model.train_function = None
    model.fit(x, y, epochs=1, verbose=0)
    assert aggregator._book.checks == checks  # a retrace under the same membership: no new check
    state = elastic.KerasState(model, epoch=0)
    state.reset()
    model.fit(x, y, epochs=1, verbose=0)
    assert aggregator._book.checks == checks + 1


def test_run_refuses_an_mpi_launch_saying_how_to_launch(monkeypatch):
    monkeypatch.setattr(elastic._hvd, "mpi_enabled", lambda: True)
    train = elastic.run(lambda state: "trained")
    with pytest.raises(elastic.ElasticError, match="horovodrun --gloo .*--min-np"):
        train(elastic.ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, epoch=0))


def test_a_residual_written_under_another_membership_is_read_as_zeros():
    memory = ResidualMemory("elastic_test")
    memory.variable("b0", 3)
    memory.restore({"b0.residual": np.full([3], 7.0, np.float32), "b0.owner": np.array([0, 4], np.int32),
                    "b0.scale": np.asarray(1.0)})
    # rank 0 of 4 wrote it; this process is rank 0 of 1 (a smaller world after a reset)
    assert np.all(memory.read("b0", 3, tf.float32).numpy() == 0.0)
    me = topology()
    memory.restore({"b0.residual": np.full([3], 7.0, np.float32),
                    "b0.owner": np.array([me.rank, me.size], np.int32), "b0.scale": np.asarray(1.0)})
    assert np.all(memory.read("b0", 3, tf.float32).numpy() == 7.0)


def test_run_resets_after_a_failed_collective_and_raises_every_other_error(monkeypatch):
    """Horovod's TensorFlow `run` returned None (training over) on an UnknownError naming no
    Horovod op type, e.g. the shutdown error of a traced hvdx collective after a rank died;
    hvdx's run classifies by the shutdown message too, and lets any other error through."""
    shut_down = tf.errors.UnknownError(None, None, "Horovod has been shut down. This was caused by an exception "
                                       "on one of the ranks [[{{node hitopk/hvdx.hitopk.ag.v0_b0}}]]")
    assert elastic._is_collective_failure(shut_down)
    assert elastic._is_collective_failure(tf.errors.UnknownError(None, None, "in HorovodAllreduce_grads_0"))
    reset = ("Graph execution error: Detected at node hierarchical_1/hvdx.2dtar.ar.v0_b1 ... [/tmp/horovod/third_party/"
             "compatible17_gloo/gloo/transport/tcp/pair.cc:589] Read error [10.77.0.2]:46245: Connection reset by peer")
    assert elastic._is_collective_failure(tf.errors.UnknownError(None, None, reset))  # the op running when it died
    removed = ("Allgather: Process set provided does not exist, or has not been registered. "
               "[[{{node hitopk/hvdx.hitopk.ag2.v0_b0}}]]")  # enqueued after the failed loop removed hvdx's sets
    assert elastic._is_collective_failure(tf.errors.InvalidArgumentError(None, None, removed))
    bug = tf.errors.UnknownError(None, None, "a user's layer failed")
    assert not elastic._is_collective_failure(bug) and not elastic._is_collective_failure(ValueError("x"))

    def train(state):
        raise bug

    monkeypatch.setattr(elastic._hvd, "mpi_enabled", lambda: False)  # this test process runs under MPI
    with pytest.raises(tf.errors.UnknownError, match="a user's layer failed"):
        elastic.run(train)(elastic.ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, epoch=0))


# -- the elastic launch: 2 emulated nodes x 2 ranks -> node localhost removed -> 1 x 2 ---------

ELASTIC_TIMEOUT = 300  # seconds: the job is killed (its whole process tree) past this


def _write_digit_jpegs(root) -> str:
    """The digits' training split as 8 px grayscale JPEGs in class folders "0".."9"."""
    import os

    import tensorflow as tf

    from tests.multirank import digits

    x_train, _, y_train, _ = digits.split((8, 8, 1))
    for i, (x, y) in enumerate(zip(x_train, y_train)):
        os.makedirs(root / str(y), exist_ok=True)
        pixels = tf.constant((x * 255).round().astype("uint8"))
        tf.io.write_file(str(root / str(y) / f"{i:04d}.jpg"), tf.io.encode_jpeg(pixels, quality=95))
    return str(root)


def _discovery_script(tmp_path):
    """(the hosts file, the discovery script printing it): 2 emulated nodes of 2 slots."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:2\nlocalhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    return hosts, discover


def _elastic_digits(tmp_path, communication: str, schedule: str, datacache: bool = False, keras3: bool = False):
    """Runs tests/multirank/elastic_digits.py on 2x2 under a discovery script (with
    `datacache`: its batches from a DataCache over the digits as JPEGs; with `keras3`: without
    $TF_USE_LEGACY_KERAS, tf.keras as TensorFlow makes it, Keras 3 from 2.16 on); returns (the
    job, rank 0's record) after checking that it ended in time and rc 0."""
    import json
    import sys

    from tests import harness

    hosts, discover = _discovery_script(tmp_path)
    from hvdx.runner.launch import HOROVODRUN

    command = [str(HOROVODRUN), "--gloo", "-np", "4", "--min-np", "2", "--max-np", "4",
               "--host-discovery-script", str(discover), sys.executable,
               str(harness.MULTIRANK / "elastic_digits.py"), "hvdx", communication, str(hosts), "5", schedule]
    env = harness.test_env(str(tmp_path))
    if keras3:
        env.pop("TF_USE_LEGACY_KERAS", None)
    if datacache:
        env["HVDX_ELASTIC_DATACACHE"] = _write_digit_jpegs(tmp_path / "digits")
    job = harness.run(command, timeout=ELASTIC_TIMEOUT, env=env, cwd=harness.ROOT)
    failed = sorted({line.split("]")[0][1:] for line in (job.output or "").splitlines()
                     if line.startswith("[") and "Traceback" in line})
    assert not job.timed_out, f"the elastic job hung past {ELASTIC_TIMEOUT} s:\n{(job.output or '')[-4000:]}"
    assert job.returncode == 0, f"ranks {failed} failed (rc {job.returncode}):\n{(job.output or '')[-4000:]}"
    return job, json.loads((tmp_path / "elastic.json").read_text())


@pytest.mark.multirank
def test_hitopk_keras_training_runs_flat_when_a_node_loses_one_rank_then_even_again(tmp_path):
    """2x2 -> nodes of 2 and 1 ranks: hvdx runs flat (every rank a node of its own, one
    warning), HiTopK's residuals of the old slices start from zero; the rank comes back (a new
    process that never trained: its optimizer is built before Horovod's sync, and the ranks
    check the step's layout again together; Horovod started it before telling the survivors,
    who trained on meanwhile: patch 0004) -> 2x2, hierarchical again, and the job ends.
    The batches come from a DataCache that every reset splits again over the ranks (3 nodes
    of one rank, then 2x2 again), its node stores kept."""
    import json

    job, record = _elastic_digits(tmp_path, "hitopk", "shrink,add", datacache=True)
    assert record["sizes"] == [4, 3, 4], record
    assert record["spreads"] == [0.0, 0.0, 0.0] and record["final_spread"] == 0.0, record
    assert record["size"] == 4 and record["accuracy"] > 0.8, record  # it learns (chance: 0.1; 0.90 seen)
    assert "every rank runs as a node of its own" in job.output, job.output[-4000:]
    assert "the layout now needs" in job.output  # the 2x2 slices' residuals, dropped with a warning
    # the returning rank's process was started before the survivors were told of its host
    # (Horovod patch 0004): it had reached hvd.init when rank 0 got the notice
    processes = [json.loads(p.read_text()) for p in tmp_path.glob("process-*.json")]
    (back,) = [p for p in processes if p["prelaunched"]]
    assert len(processes) == 4 and back["before_init"] < record["notices"][-1], (processes, record)
    # The batches came from a DataCache, split again at each reset (2 nodes, 3 flat, 2): the
    # surviving nodes' ranks read the samples their stores lacked under the flat split (more
    # than their node's part), none of them twice, and ended on the split they began with
    from collections import Counter

    ranks = [json.loads(p.read_text()) for p in tmp_path.glob("reads-*.json")]
    survivors = [r for r in ranks if r["sizes"][:2] == [4, 3]]
    assert len(ranks) == 4 and len(survivors) == 3, ranks
    for host in {r["host"] for r in survivors}:
        reads = Counter()
        for r in survivors:
            if r["host"] == host:
                reads.update(r["reads"])
        assert reads and max(reads.values()) == 1, (host, reads.most_common(3))
        if sum(r["host"] == host for r in survivors) == 2:  # the node that kept both ranks
            assert len(reads) > max(r["part"] for r in survivors if r["host"] == host), len(reads)
    assert len({r["part"] for r in ranks}) <= 2 and all(r["part"] >= 1347 // 2 - 1 for r in ranks), ranks


@pytest.mark.second_stack
@pytest.mark.multirank
def test_horovods_elastic_example_runs_on_when_a_node_comes_back(tmp_path):
    """Horovod's elastic Keras example's pattern, Adam and a one-step `fit` before
    `hvd.elastic.run` (the returning node's new processes) and in the reset callback (the
    survivors'), 2x2 -> 1x2 -> 2x2: the ranks' first collectives after the return match with
    a strategy that keeps state per rank (HiTopK: residuals, the warm-up's stage), and the
    job ends with one model everywhere. With HiTopK (Adam: the density warm-up, stage by the
    buffer's step counter) every rank waited in its first HiTopK call until the watchdog
    ended the job: the new processes were in the warm-up's first stage, the survivors in its
    last (`TopKStrategy.agree_state` takes the largest). (A strategy that rebuilds its process
    sets at the node's return, 2DTAR: the DAWNBench test below, which switches to it before.)"""
    job, record = _elastic_digits(tmp_path, "hitopk", "remove,add,horovod")
    assert record["sizes"] == [4, 2, 4], record
    assert record["spreads"] == [0.0, 0.0, 0.0] and record["final_spread"] == 0.0, record
    assert record["size"] == 4 and record["accuracy"] > 0.8, record  # it learns (chance: 0.1)
    assert "watchdog" not in job.output, job.output[-4000:]
    _assert_residuals_per_rank(record, job)


def _assert_residuals_per_rank(record, job):
    """HiTopK's residuals after 2x2 -> 1x2 -> 2x2: never broadcast nor restored by the state,
    each rank ends with its own (owned by it under the last membership, different norms), the
    step counters agreed by the ranks; the survivors' residuals written under 4 ranks were
    read as zeros, with a warning, under 2."""
    residuals = sorted(record["residuals"], key=lambda r: r["rank"])
    assert [r["rank"] for r in residuals] == [0, 1, 2, 3], residuals
    assert all(r["owners"] == [[r["rank"], 4]] for r in residuals), residuals
    assert all(r["norm"] > 0 for r in residuals) and len({r["norm"] for r in residuals}) == 4, residuals
    assert all(r["steps"] == residuals[0]["steps"] for r in residuals) and residuals[0]["steps"], residuals
    assert "was written by rank" in job.output, job.output[-4000:]


@harness.KERAS3
@pytest.mark.multirank
def test_a_keras3_model_trains_on_when_a_node_leaves_and_comes_back(tmp_path):
    """Horovod's elastic Keras example's pattern written for Keras 3 (`import keras`, hvdx's
    Keras 3 wrapper with HiTopK, hvd.callbacks' MetricAverageCallback and Horovod's elastic
    callbacks in Keras 3's `fit`, hvdx.elastic's Keras 3 state), launched with tf.keras as
    Keras 3, 2x2 -> 1x2 -> 2x2: the ranks, seeded apart, are one model after every sync (the
    returning node's new processes too: their optimizer built before it), the job ends with
    every rank bitwise identical and learns; the residuals stay per rank as on the Keras 2
    path (`test_horovods_elastic_example_runs_on_when_a_node_comes_back`)."""
    job, record = _elastic_digits(tmp_path, "hitopk", "remove,add,horovod,keras3", keras3=True)
    assert record["tf_keras_is_keras3"] and record["state"] == ["KerasState", "Keras3State"], record
    assert record["sizes"] == [4, 2, 4], record
    assert record["spreads"] == [0.0, 0.0, 0.0] and record["final_spread"] == 0.0, record
    assert record["size"] == 4 and record["accuracy"] > 0.8, record  # it learns (chance: 0.1)
    assert job.output.count("ELASTIC_DONE") == 4 and "watchdog" not in job.output, job.output[-4000:]
    _assert_residuals_per_rank(record, job)


def test_an_elastic_job_waits_longer_at_a_rendezvous_than_in_a_collective(monkeypatch):
    """hvdx.init in an elastic job sets Horovod's rendezvous timeout (patch 0003) unless set."""
    import importlib

    topology_module = importlib.import_module("hvdx.topology")

    monkeypatch.delenv(topology_module.RENDEZVOUS_TIMEOUT_ENV, raising=False)
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    topology_module.elastic_defaults()
    assert topology_module.RENDEZVOUS_TIMEOUT_ENV not in os.environ  # not elastic: Horovod's one timeout
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    topology_module.elastic_defaults()
    assert os.environ[topology_module.RENDEZVOUS_TIMEOUT_ENV] == "120"
    monkeypatch.setenv(topology_module.RENDEZVOUS_TIMEOUT_ENV, "45")
    topology_module.elastic_defaults()
    assert os.environ[topology_module.RENDEZVOUS_TIMEOUT_ENV] == "45"  # the user's


@pytest.mark.multirank
def test_a_rendezvous_waits_for_a_late_rank_beyond_the_collective_timeout(tmp_path):
    """Horovod patch 0003: with a 3 s collective timeout (HOROVOD_GLOO_TIMEOUT_SECONDS) and a
    60 s rendezvous timeout, rank 1 starting Horovod 8 s after rank 0 (as an added host's
    processes do while they import TensorFlow) joins; without the patch rank 0 gave up after
    3 s ("Wait timeout")."""
    import sys

    from hvdx.runner.launch import HOROVODRUN
    from tests import harness

    script = ("import os, time; rank = int(os.environ['HOROVOD_RANK']); time.sleep(8 * rank); "
              "import horovod.tensorflow as hvd, tensorflow as tf; hvd.init(); "
              "print('SUM', int(hvd.allreduce(tf.constant(rank + 1), op=hvd.Sum)), flush=True)")
    env = dict(harness.test_env(str(tmp_path)), HOROVOD_GLOO_TIMEOUT_SECONDS="3",
               HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS="60")
    job = harness.run([str(HOROVODRUN), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-c", script],
                      timeout=120, env=env, cwd=tmp_path)
    assert not job.timed_out and job.returncode == 0, (job.output or "")[-3000:]
    assert (job.output or "").count("SUM 3") == 2, (job.output or "")[-3000:]


@pytest.mark.second_stack
@pytest.mark.multirank
def test_hitopk_keras_training_survives_a_killed_rank(tmp_path):
    """Rank 3 of 2x2 SIGKILLs itself after epoch 1 (a preempted process): the survivors'
    Horovod fails its collective, finalizes hvdx's node-local and cross-node process sets
    locally (scripts/patches/horovod-0.28.1/0002-...) and raises HorovodInternalError; the
    elastic run restores the last commit, Horovod blacklists the dead rank's host and the job
    ends on the other node with one model on every rank."""
    job, record = _elastic_digits(tmp_path, "hitopk", "kill")
    assert record["sizes"] == [4, 2], record
    assert record["spreads"] == [0.0, 0.0] and record["final_spread"] == 0.0, record
    assert record["size"] == 2 and record["accuracy"] > 0.85, record
    assert "kills itself" in job.output


# One method under Horovod's elastic driver: the driver's path (TrainingMethodCallback,
# hvdx.elastic's reset, lifecycle.reset_running) is the same for each; AD-PSGD's and ASSM's
# own reset and a process joining them are 2x2 checks in tests/test_lifecycle.py (adpsgd.reset,
# .join, .callback_join, asynchronous.reset); HVDX_ELASTIC_METHODS=daso,adpsgd,assm runs them
# here too (the three cost CI 81 s of a tail that runs alone).
ELASTIC_METHODS = os.environ.get("HVDX_ELASTIC_METHODS", "daso").split(",")


@pytest.mark.multirank
@KERAS3_ONLY
@pytest.mark.parametrize("method", ELASTIC_METHODS)  # LARS(pto): the DAWNBench test below
def test_training_methods_and_lars_survive_a_membership_change(tmp_path, method):
    """DASO (AD-PSGD and ASSM with HVDX_ELASTIC_METHODS) on a Keras 3 model and optimizer
    (tf.keras as TensorFlow makes it, the Keras 3 elastic state; their reset is the same code
    under Keras 2: DASO's on 2x2 in tests/test_lifecycle.py) under `TrainingMethodCallback`: a
    removed node interrupts `fit` with the method running; hvdx.elastic's reset closes it and
    plans it for the new ranks (`hvdx.lifecycle.reset_running`: DASO's node process set and
    groups, AD-PSGD's graph, ASSM's node segment), the next `fit` starts it collectively; the
    node added back starts new processes whose methods join the old ranks' (DASO takes rank
    0's schedule, AD-PSGD's transports the ranks' largest run count). Every rank ends with one
    model. (LARS(parallel="pto") under HiTopK, which plans its shares again at the retrace:
    the DAWNBench test below. A killed rank with DASO and AD-PSGD: ended rc 0 on 2 ranks by
    hand, docs/elastic.md.)"""
    job, record = _elastic_digits(tmp_path, method, "remove,add,keras3", keras3=True)
    assert record["sizes"] == [4, 2, 4], record
    assert record["spreads"] == [0.0, 0.0, 0.0] and record["final_spread"] == 0.0, record
    assert record["size"] == 4 and record["accuracy"] > 0.85, record
    assert record["tf_keras_is_keras3"] and record["state"] == ["KerasState", "Keras3State"], record



@pytest.mark.multirank
def test_the_dawnbench_recipe_goes_on_when_a_node_leaves_and_comes_back(tmp_path):
    """examples/dawnbench.py --elastic (LARS with the parallel tensor operator, HiTopK then
    2DTAR, DataCache, a checkpoint per epoch) as a user runs it (tf.keras as TensorFlow makes
    it: Keras 3 from 2.16 on; Keras 2 on the TensorFlow 2.15 stack) on 2x2 under a discovery script that drops
    node localhost after epoch 1 and lists it again after epoch 3: the run ends rc 0 with all
    6 epochs, trained on 4, then 2, then 4 ranks, each epoch with its DataCache's steps for
    those ranks, the learning rate following the epochs through the size changes."""
    import json
    import subprocess
    import sys
    import time

    from hvdx.runner.launch import HOROVODRUN, kill_tree
    from tests import harness

    data = _write_digit_jpegs(tmp_path / "digits")
    hosts, discover = _discovery_script(tmp_path)
    out = tmp_path / "out"
    command = [str(HOROVODRUN), "--gloo", "-np", "4", "--min-np", "2", "--max-np", "4",
               "--host-discovery-script", str(discover), sys.executable, str(harness.ROOT / "examples" / "dawnbench.py"),
               "--preset", "demo", "--elastic", "--data", data, "--val-data", data, "--phases", "2x16@16,4x20@16",
               "--switch-epoch", "2", "--lr", "8", "--warmup-epochs", "1", "--se-steps", "0", "--no-plot",
               "--verbose", "0", "--out", str(out)]
    log = open(tmp_path / "job.log", "w")
    # Horovod's order at the node's return (patch 0004 off): the survivors wait for the new
    # processes, so they join however soon the job would end (test_hitopk_keras_training_runs_
    # flat... tests the new processes started ahead)
    env = dict(harness.test_env(str(tmp_path)), HOROVOD_ELASTIC_PRELAUNCH="0")
    env.pop("TF_USE_LEGACY_KERAS", None)  # as a user runs it: tf.keras as TensorFlow makes it (Keras 3 on 2.16+)
    job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                           cwd=str(tmp_path), start_new_session=True)
    changes = [(2, "127.0.0.1:2\n"), (4, "127.0.0.1:2\nlocalhost:2\n")]  # (committed epochs, host list)
    deadline = time.monotonic() + ELASTIC_TIMEOUT
    try:
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                done = json.loads((out / "state.json").read_text())["epoch"]
            except (OSError, ValueError, KeyError):
                continue
            if changes and done >= changes[0][0]:
                hosts.write_text(changes.pop(0)[1])
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
        log.close()
    output = (tmp_path / "job.log").read_text()
    assert job.returncode == 0, f"rc {job.returncode} (hung: {time.monotonic() >= deadline}):\n{output[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "state.json").read_text())["history"]
    ranks = [h["ranks"] for h in history]
    assert [h["epoch"] for h in history] == list(range(6)) and not changes, (ranks, changes)
    assert ranks[:2] == [4, 4] and 2 in ranks and ranks[-1] == 4, ranks
    # 1347 samples: 2 nodes' parts of 674 and 673 -> 336 per rank; one node -> 673 per rank; batch 16
    assert [h["steps"] for h in history] == [{4: 21, 2: 42}[r] for r in ranks], history
    # the rate at each epoch's last step, lr(e) = 8 ((6 - e) / 5)^2 after the 1-epoch warm-up,
    # e counted with the steps per epoch of the ranks that trained it
    expected = [8 * ((6 - (h["epoch"] + 1 - 1 / h["steps"])) / 5) ** 2 for h in history[1:]]
    assert np.allclose([h["lr"] for h in history[1:]], expected, rtol=1e-3, atol=1e-4), history
    assert summary["epochs"] == 6, summary


@pytest.mark.multirank
def test_a_node_preempted_on_the_emulated_cluster_leaves_and_rejoins(tmp_path):
    """The emulated cluster's elastic mode, as benchmarks/elastic.py runs it: horovodrun in the
    switch namespace, each node's workers in its own namespace on its own core; node 1 is
    SIGKILLed mid-epoch and dropped from the discovery script, later listed again: HiTopK
    trains on 4 -> 2 -> 4 ranks to the last epoch and the job ends rc 0 (with Horovod's own
    TensorFlow `run`, the survivors' training ended silently at the preemption)."""
    import json
    import subprocess
    import sys

    from tests import harness

    why = harness.cluster_unavailable()
    if why:
        pytest.skip(why)
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "elastic.py"), "--smoke", "--cases",
                           "elastic", "--methods", "hitopk", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          # the smoke run's last third is shorter than a new process' start: with
                          # the node's processes started ahead (patch 0004) the run may end first
                          env=dict(harness.test_env(str(tmp_path)), HOROVOD_ELASTIC_PRELAUNCH="0"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "elastic.json").read_text())
    (run,) = result["runs"]
    log = proc.stdout[-4000:]
    assert run["exit_codes"] == [0], log
    assert {"preempted", "back", "training_done"} <= set(run["events"]), (run["events"], log)
    sizes = [r["size"] for r in run["records"]]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4, (sizes, log)
    assert run["records"][-1]["epoch"] == result["arguments"]["epochs"], log
