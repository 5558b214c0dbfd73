"""Launching under MPI (docs/launching.md): `mpirun` 1 x 4, `horovodrun --mpi`, and `mpirun`
2 x 2 on nodes emulated with UTS namespaces (hvdx/runner/mpi.py), each training the digits demo
to its end with every rank holding the same weights, and AD-PSGD's transport under mpirun on
two emulated nodes; and hvdx's own part (hvdx/mpi_defaults.py):
Open MPI told to yield the core while it waits where ranks outnumber cores, a warning with the
flags to pass where hvdx cannot tell it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvdx import legacy_keras, mpi_defaults as launcher
from hvdx.runner import launch, mpi, slurm
from tests import harness

DEMO = str(harness.ROOT / "examples" / "train_digits.py")
EPOCHS = 5
MPI_UNAVAILABLE = mpi.mpi_unavailable()
EMULATION_UNAVAILABLE = mpi.emulation_unavailable()
needs_mpi = pytest.mark.skipif(MPI_UNAVAILABLE is not None, reason=str(MPI_UNAVAILABLE))
needs_emulation = pytest.mark.skipif(EMULATION_UNAVAILABLE is not None, reason=str(EMULATION_UNAVAILABLE))
SLURM_UNAVAILABLE = slurm.slurm_unavailable() or MPI_UNAVAILABLE
needs_slurm = pytest.mark.skipif(SLURM_UNAVAILABLE is not None, reason=str(SLURM_UNAVAILABLE))


# -- hvdx.mpi_defaults: what the environment tells before MPI_Init -----------------------------

def test_open_mpi_ranks_are_recognised_with_their_machine_count():
    info = launcher.detect({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, cores=2)
    assert (info.launcher, info.local_size, info.mpi, info.oversubscribed) == ("openmpi", 4, True, True)
    assert not launcher.detect({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, cores=2).oversubscribed


def test_slurm_tasks_per_node_are_read_for_this_node():
    env = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),3"}
    info = launcher.detect(env, cores=2)
    assert (info.launcher, info.local_size, info.oversubscribed) == ("slurm", 3, True)
    assert launcher.detect({**env, "SLURM_NODEID": "1"}, cores=2).local_size == 2


def test_gloo_and_plain_processes_are_not_mpi():
    gloo_env = {"HOROVOD_RANK": "0", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "x", "HOROVOD_LOCAL_SIZE": "8"}
    gloo = launcher.detect(gloo_env, cores=2)
    assert (gloo.launcher, gloo.mpi, gloo.oversubscribed) == ("horovodrun", False, True)
    assert launcher.detect({}, cores=2) == launcher.LaunchInfo("none", None, 2)
    assert launcher.apply_mpi_defaults({}, gloo) == {}


def test_oversubscribed_mpi_ranks_are_told_to_yield_before_mpi_init():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    applied = launcher.apply_mpi_defaults(env, launcher.detect(env, cores=2))
    assert applied == {"OMPI_MCA_mpi_yield_when_idle": "1"} and env["OMPI_MCA_mpi_yield_when_idle"] == "1"


def test_mpi_defaults_leave_ranks_that_fit_and_the_users_choice_alone():
    fits = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert launcher.apply_mpi_defaults(fits, launcher.detect(fits, cores=2)) == {}
    assert "OMPI_MCA_mpi_yield_when_idle" not in fits
    own = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_MCA_mpi_yield_when_idle": "0"}
    assert launcher.apply_mpi_defaults(own, launcher.detect(own, cores=2)) == {}
    assert own["OMPI_MCA_mpi_yield_when_idle"] == "0"
    off = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "HVDX_MPI_DEFAULTS": "0"}
    assert launcher.apply_mpi_defaults(off, launcher.detect(off, cores=2)) == {}


def test_hvdx_init_sets_the_defaults_before_horovod_initializes_mpi(monkeypatch):
    import importlib

    topology = importlib.import_module("hvdx.topology")  # the module (hvdx.topology is also a function)
    seen = {}

    class Stop(Exception):
        pass

    def fake_init(**_):
        seen.update(os.environ)
        raise Stop

    monkeypatch.setattr(topology, "_topology", None)
    hvd = topology._horovod()  # horovod.tensorflow, which hvdx.init() imports on first use
    monkeypatch.setattr(hvd, "is_initialized", lambda: False)
    monkeypatch.setattr(hvd, "init", fake_init)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "64")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(4 * launcher.usable_cores()))
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    monkeypatch.delenv("HVDX_MPI_DEFAULTS", raising=False)
    with pytest.raises(Stop):
        topology.init()
    assert seen.get("OMPI_MCA_mpi_yield_when_idle") == "1"


def test_cgroup_quota_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert launcher.usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert launcher.usable_cores(str(tmp_path)) == (os.cpu_count() or 1)


def test_warning_names_the_flags_when_emulated_nodes_share_a_machine_and_spin():
    # Two nodes of 2 ranks, each fitting its 2 cores as its launcher sees it, on one machine.
    spinning = [launcher.MachineFacts("boot-a", 2, yields=False)] * 4
    message = launcher.oversubscription_warning(spinning, mpi=True)
    assert "4 ranks on 2 core(s)" in message and "--mca mpi_yield_when_idle 1" in message
    assert "export OMPI_MCA_mpi_yield_when_idle=1" in message and "docs/launching.md" in message


def test_no_warning_when_ranks_yield_fit_or_do_not_use_mpi():
    assert launcher.oversubscription_warning([launcher.MachineFacts("a", 2, yields=True)] * 4, mpi=True) is None
    two_machines = [launcher.MachineFacts(m, 2, yields=False) for m in ("a", "a", "b", "b")]
    assert launcher.oversubscription_warning(two_machines, mpi=True) is None
    assert launcher.oversubscription_warning([launcher.MachineFacts("a", 2, yields=False)] * 4, mpi=False) is None


# -- hvdx.runner.mpi: the command lines docs/launching.md shows ------------------------------

def test_mpirun_command_carries_root_oversubscription_and_parameters():
    command = mpi.mpirun_command(["python", "t.py"], np=4, oversubscribe=True, root=True,
                                 mca={"mpi_yield_when_idle": "1"}, forward=())
    assert command == ["mpirun", "-np", "4", "--allow-run-as-root", "--oversubscribe", "--mca",
                       "mpi_yield_when_idle", "1", "--tag-output", "python", "t.py"]
    assert "--allow-run-as-root" not in mpi.mpirun_command(["x"], np=1, root=False, forward=())
    with pytest.raises(ValueError, match="hosts or hostfile"):
        mpi.mpirun_command(["x"], np=2, hosts="a:2", hostfile=Path("h"))


def test_srun_command_asks_for_pmix_and_equal_tasks_per_node():
    assert mpi.srun_command(["python", "t.py"], nodes=2, ranks_per_node=2) == [
        "srun", "--mpi=pmix", "-N", "2", "--ntasks-per-node", "2", "-n", "4", "python", "t.py"]


def test_emulated_nodes_write_a_hostfile_and_remove_it():
    with mpi.EmulatedNodes(2, 3) as nodes:
        hostfile = nodes.hostfile
        assert hostfile.read_text() == "hvdx-node0 slots=3\nhvdx-node1 slots=3\n"
        command = nodes.command(["python", "t.py"])
        assert command[command.index("--hostfile") + 1] == str(hostfile)
        assert command[command.index("plm_rsh_agent") + 1] == str(mpi.AGENT)
        assert command[command.index("--bind-to") + 1] == "none"
        # 6 ranks on this machine's cores: yield unless the cores outnumber them
        assert ("mpi_yield_when_idle" in command) == (6 > (os.cpu_count() or 1))
    assert not hostfile.exists()
    with pytest.raises(RuntimeError, match="with EmulatedNodes"):
        nodes.command(["x"])


def test_srun_labels_and_failed_tasks_are_read_too():
    output = "0: hello\n1: Traceback\n1: ValueError: boom\nsrun: error: hvdx-node0: task 1: Exited with exit code 1\n"
    assert mpi.rank_lines(output) == {0: ["hello"], 1: ["Traceback", "ValueError: boom"]}
    assert mpi.failed_ranks(output) == [1]


def test_tagged_output_is_split_by_rank_and_failures_are_named():
    output = ("[1,0]<stdout>:hello\n[1,3]<stderr>:Traceback\n[1,3]<stderr>:ValueError: boom\n"
              "Primary job  terminated normally, but 1 process returned\n"
              "  Process name: [[4242,1],3]\n  Exit code:    1\n")
    assert mpi.rank_lines(output) == {0: ["hello"], 3: ["Traceback", "ValueError: boom"]}
    assert mpi.failed_ranks(output) == [3]
    (why,) = mpi.explain(output, 1, False, np=4)
    assert why.startswith("rank 3 failed") and "ValueError: boom" in why
    assert mpi.explain("", 0, False, np=4) == []


@needs_emulation
def test_uts_agent_starts_the_command_on_a_machine_of_the_hosts_name():
    out = subprocess.run([str(mpi.AGENT), "-x", "hvdx-node7", "hostname; echo 'a  b'"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["hvdx-node7", "a  b"]
    assert subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip() != "hvdx-node7"


# -- the digits demo under each MPI launcher, to its end -------------------------------------

def train_digits(command: list, np: int, timeout: float = 420, env: dict = None) -> dict:
    """Runs the demo under `command` (an MPI launcher's line around it) as a user does, with
    the Keras TensorFlow gives (no $TF_USE_LEGACY_KERAS: Keras 3 from TensorFlow 2.16 on);
    returns rank 0's lines, or fails naming each rank that failed with its last output."""
    env = dict(env or harness.test_env())
    env.pop(legacy_keras.ENV, None)
    job = launch.run(command, timeout=timeout, env=env, cwd=harness.ROOT)
    problems = mpi.explain(job.output, job.returncode, job.timed_out, np)
    assert not problems, f"{' '.join(command)}\n\n" + "\n\n".join(problems)
    lines = mpi.rank_lines(job.output) or {0: job.output.splitlines()}
    return {"output": "\n".join(lines.get(0, [])), "ranks": sorted(lines)}


def assert_trained(out: dict, nodes: int, per_node: int) -> None:
    text = out["output"]
    assert "more MPI ranks than cores" not in text, text  # the ranks yield: no warning
    assert f"hvdx topology: {nodes} node(s) x {per_node} rank(s)" in text, text
    assert f"trained {EPOCHS} epochs" in text and f"over {nodes * per_node} ranks" in text, text
    assert f"weights agree on all {nodes * per_node} ranks" in text, text
    assert f"(Keras {3 if harness.HAS_KERAS3 else 2}." in text, text  # TensorFlow's own Keras
    accuracy = float(text.split("test accuracy ")[1].split(",")[0])
    assert accuracy > 0.85, text  # an MLP on the digits reaches ~0.9 in a few epochs


@pytest.mark.multirank
@needs_mpi
def test_mpirun_one_node_of_four_trains_the_demo_to_the_end():
    command = mpi.mpirun_command([sys.executable, DEMO, "--epochs", str(EPOCHS)], np=4,
                                 oversubscribe=4 > (os.cpu_count() or 1))
    assert_trained(train_digits(command, np=4), nodes=1, per_node=4)


@pytest.mark.second_stack
@pytest.mark.multirank
@needs_mpi
def test_horovodrun_mpi_trains_the_demo_to_the_end():
    # -H localhost:4 declares 4 slots: mpirun does not know it oversubscribes 2 cores, so
    # the ranks would spin; hvdx.init() tells Open MPI to yield (hvdx/mpi_defaults.py).
    command = launch.horovodrun_command([sys.executable, DEMO, "--epochs", str(EPOCHS)], np=4,
                                       hosts="localhost:4", controller="mpi")
    assert_trained(train_digits(command, np=4), nodes=1, per_node=4)


@pytest.mark.multirank
@needs_emulation
def test_mpirun_two_emulated_nodes_of_two_train_the_demo_to_the_end():
    with mpi.EmulatedNodes(2, 2) as nodes:
        out = train_digits(nodes.command([sys.executable, DEMO, "--epochs", str(EPOCHS)]), np=4)
    assert_trained(out, nodes=2, per_node=2)


ADPSGD_FIT = """
import sys
import numpy as np, tensorflow as tf, hvdx
from hvdx.adpsgd import ADPSGDCallback
from hvdx.zoo import mlp
from sklearn.datasets import load_digits
topo = hvdx.init()
x, y = load_digits(return_X_y=True)
x = (x / 16).astype("float32")
model = mlp(64, (32,), seed=topo.rank)
model.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
gossip = ADPSGDCallback(topology="ring", cross_node_weight=0.5, timeout=60)
model.fit(x[topo.rank::topo.size], y[topo.rank::topo.size], epochs=2, batch_size=16, verbose=0, callbacks=[gossip])
digest = float(sum(float(np.abs(w).sum()) for w in model.get_weights()))
sys.stdout.write(f"ADPSGD {topo.rank} node {topo.node} of {topo.num_nodes} exchanges {gossip.stats['exchanges']} "
                 f"weights {digest:.6f}\\n")  # one write: one tagged line (print's newline may come apart)
sys.stdout.flush()
hvdx.barrier()
"""


@pytest.mark.multirank
@needs_emulation
def test_mpirun_two_emulated_nodes_run_adpsgd_to_the_same_average_model(tmp_path):
    """AD-PSGD's transport where mpirun puts ranks (issue 24): no Gloo rendezvous, hvdx's nodes
    from MPI's, the neighbour weights across them; every rank ends with the average model."""
    script = tmp_path / "adpsgd_fit.py"
    script.write_text(ADPSGD_FIT)
    with mpi.EmulatedNodes(2, 2) as nodes:
        command = nodes.command([sys.executable, str(script)])
        job = launch.run(command, timeout=300, env=harness.test_env(), cwd=harness.ROOT)
    problems = mpi.explain(job.output, job.returncode, job.timed_out, 4)
    assert not problems, f"{' '.join(command)}\n\n" + "\n\n".join(problems)
    lines = [line for rank_lines in mpi.rank_lines(job.output).values() for line in rank_lines
             if line.startswith("ADPSGD ")]
    assert len(lines) == 4, job.output
    fields = [line.split() for line in lines]
    # "ADPSGD <rank> node <node> of <nodes> exchanges <n> weights <sum of |w|>"
    assert sorted(f[3] for f in fields) == ["0", "0", "1", "1"] and {f[5] for f in fields} == {"2"}, lines
    # rank 0 (active: it starts exchanges) averaged with its neighbours; a passive rank may finish
    # its few steps before an exchange reaches it, and still ends with the average below
    assert int(next(f for f in fields if f[1] == "0")[7]) > 0, lines
    assert len({f[9] for f in fields}) == 1, lines    # the same (average) model everywhere


# -- mpirun on the emulated cluster (hvdx/runner/cluster.py): namespaces, shaped links --------

CLUSTER_UNAVAILABLE = harness.cluster_unavailable() or EMULATION_UNAVAILABLE
needs_cluster = pytest.mark.skipif(CLUSTER_UNAVAILABLE is not None, reason=str(CLUSTER_UNAVAILABLE))
MPI_ALLREDUCE = """
import socket, subprocess, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
eth0 = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout.split()[3]
total = comm.allreduce(comm.rank)
sys.stdout.write(f"RANK {comm.rank} {socket.gethostname()} {eth0} {total}\\n")  # one write: one tagged line
sys.stdout.flush()
"""


@pytest.mark.multirank
@needs_cluster
def test_mpirun_on_the_emulated_cluster_places_ranks_in_their_nodes_namespace(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(MPI_ALLREDUCE)
    with harness.network_lock():
        job = launch.run(launch.cluster_command([sys.executable, str(script)], nodes=2, ranks_per_node=2,
                                                timeout=120, mpi=True), timeout=180, env=harness.test_env())
    assert job.returncode == 0, job.output
    seen = sorted(line.split("RANK ", 1)[1] for line in job.output.splitlines() if "RANK " in line)
    assert seen == ["0 node0 10.77.0.1/24 6", "1 node0 10.77.0.1/24 6", "2 node1 10.77.0.2/24 6",
                    "3 node1 10.77.0.2/24 6"], job.output


# -- SLURM: a throwaway cluster of two nodes on this machine (hvdx/runner/slurm.py) ------------

@pytest.fixture(scope="module")
def local_slurm():
    with slurm.LocalSlurm(nodes=2, cpus_per_node=2) as cluster:
        yield cluster


@needs_slurm
def test_throwaway_slurm_places_tasks_on_its_named_nodes_and_leaves_nothing_behind():
    with slurm.LocalSlurm(nodes=2, cpus_per_node=2) as cluster:
        folder, pids = cluster.dir, [p.pid for p in cluster._procs]
        out = launch.run(cluster.command(["sh", "-c", "echo $(hostname) $SLURM_LOCALID"]), timeout=120,
                         env=cluster.environment())
        assert out.returncode == 0, out.output + cluster.logs()
        assert sorted(line.split(": ", 1)[1] for line in out.output.splitlines() if ": " in line) == [
            "hvdx-node0 0", "hvdx-node0 1", "hvdx-node1 0", "hvdx-node1 1"]
    assert not folder.exists()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.multirank
@needs_slurm
def test_srun_two_nodes_of_two_trains_the_demo_to_the_end(local_slurm):
    command = local_slurm.command([sys.executable, DEMO, "--epochs", str(EPOCHS)], ranks_per_node=2)
    assert_trained(train_digits(command, np=4, env=local_slurm.environment(harness.test_env())), nodes=2, per_node=2)


@pytest.mark.multirank
@needs_slurm
def test_sbatch_script_as_a_user_writes_it_trains_the_demo(local_slurm, tmp_path):
    script = tmp_path / "digits.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=digits
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --output={tmp_path}/digits-%j.out
cd {harness.ROOT}
srun --mpi=pmix --label {sys.executable} examples/train_digits.py --epochs {EPOCHS}
""")
    env = local_slurm.environment(harness.test_env())
    job = launch.run(["sbatch", "--wait", str(script)], timeout=420, env=env, cwd=tmp_path)
    (log,) = tmp_path.glob("digits-*.out")
    output = log.read_text()
    problems = mpi.explain(output, job.returncode, job.timed_out, np=4)
    assert not problems, job.output + "\n\n" + "\n\n".join(problems)
    assert_trained({"output": "\n".join(mpi.rank_lines(output)[0])}, nodes=2, per_node=2)
