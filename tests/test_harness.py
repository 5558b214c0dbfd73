"""The multi-rank harness names the rank that failed, and times out instead of hanging; the
launching it is made of (hvdx.runner: host lists, command lines, a job under a timeout)."""
import sys
import time

import psutil
import pytest

from hvdx.runner import cluster_command, horovodrun_command, host_list, hosts, run
from hvdx.runner.launch import CLUSTER_SCRIPT, HOROVODRUN
from tests import harness


@pytest.mark.multirank
def test_reports_which_rank_failed_and_why():
    job = harness.launch("check_harness.py", "--fail-rank", "1", np=2, hosts=harness.hosts(1, 2))
    with pytest.raises(AssertionError) as info:
        job.check()
    message = str(info.value)
    assert "rank 1 failed" in message and "deliberate failure on rank 1" in message
    assert "rank 0" not in message.replace("rank 0/", "")  # rank 0 succeeded
    assert job.results[0]["ok"] and job.results[0]["data"] == {"size_seen": 2}


@pytest.mark.multirank
def test_times_out_instead_of_hanging():
    # rank 0 never writes a result, whether the timeout finds it asleep or still starting: 10 s
    # (30 s was idle time in the suite's tail, where this test runs alone)
    start, timeout = time.monotonic(), 10
    job = harness.launch("check_harness.py", "--hang-rank", "0", np=2, hosts=harness.hosts(1, 2),
                         timeout=timeout)
    assert time.monotonic() - start < timeout + 30
    assert job.timed_out
    with pytest.raises(AssertionError, match="rank 0 timed out"):
        job.check()
    assert not harness.leftover_processes(job), "ranks survived the timeout"


# -- hvdx.runner's launching, without launching Horovod ------------------------------------

def test_host_lists_name_one_emulated_node_per_entry():
    assert hosts(2, 2) == "localhost:2,127.0.0.1:2"
    assert host_list([1, 2]) == "localhost:1,127.0.0.1:2"
    assert harness.hosts(1, 3) == "localhost:3" and harness.host_list([2]) == "localhost:2"
    with pytest.raises(ValueError, match="at most 3 emulated nodes"):
        hosts(4, 1)
    with pytest.raises(ValueError, match="at least one rank"):
        host_list([2, 0])


def test_command_lines_of_both_launchers():
    rank = [sys.executable, "train.py", "--epochs", "2"]
    assert horovodrun_command(rank, np=4, hosts=hosts(2, 2)) == [
        str(HOROVODRUN), "-np", "4", "-H", "localhost:2,127.0.0.1:2", "--gloo", *rank]
    assert horovodrun_command(rank, np=4, hosts="localhost:4", controller="mpi") == [
        str(HOROVODRUN), "-np", "4", "-H", "localhost:4", "--mpi", *rank]
    with pytest.raises(ValueError, match="controller 'nccl' is not supported"):
        horovodrun_command(rank, np=4, hosts=hosts(2, 2), controller="nccl")
    with pytest.raises(ValueError, match="np >= 1"):
        horovodrun_command(rank, np=0, hosts="localhost:1")
    assert cluster_command(rank, nodes=2, ranks_per_node=1, rate="100mbit", no_delay=True, timeout=60) == [
        sys.executable, str(CLUSTER_SCRIPT), "--nodes", "2", "--ranks-per-node", "1", "--rate", "100mbit",
        "--no-delay", "--timeout", "60", "--", *rank]
    assert cluster_command(rank, nodes=3, ranks_per_node=2)[2:9] == [
        "--nodes", "3", "--ranks-per-node", "2", "--rate", "1gbit", "--"]


@pytest.mark.slow  # waits out the harness's timeout
def test_run_kills_the_whole_process_tree_when_the_timeout_expires():
    """A grandchild in a session of its own is killed too (Horovod's launcher starts ranks so)."""
    script = ("import subprocess, time; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
              "print('grandchild', p.pid, flush=True); time.sleep(300)")
    start = time.monotonic()
    job = run([sys.executable, "-c", script], timeout=10)
    assert job.timed_out and job.returncode == -9, job
    assert time.monotonic() - start < 60
    grandchild = int(job.output.split()[-1])
    try:
        assert psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped
    except psutil.NoSuchProcess:
        pass


def test_run_returns_the_status_and_the_output():
    job = run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
              timeout=60)
    assert (job.returncode, job.timed_out) == (3, False)
    assert "out" in job.output and "err" in job.output
