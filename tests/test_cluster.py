"""The emulated cluster (hvdx/runner/cluster.py): nodes as network namespaces behind shaped
links, a Horovod job across them without ssh, and nothing left behind afterwards. Its command
line (hvdx/runner/cli.py) runs as `python hvdx/runner/cluster.py` or `python -m hvdx.runner`."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hvdx.runner import cli, cluster, netns, probe, shaping
from hvdx.runner.launch import CLUSTER_SCRIPT
from tests import harness

CLUSTER_PY = str(CLUSTER_SCRIPT)
UNAVAILABLE = harness.cluster_unavailable()
needs_namespaces = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def system_state() -> dict:
    """What the cluster may touch: namespaces, root-namespace links and qdiscs, /etc/netns."""
    def run(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True).stdout

    return {"netns": sorted(netns.namespaces()),
            "links": sorted(line.split(":")[1].strip() for line in run("ip", "-o", "link").splitlines()),
            "qdiscs": sorted(run("tc", "qdisc", "show").splitlines()),
            "etc_netns": sorted(os.listdir("/etc/netns")) if os.path.isdir("/etc/netns") else []}


@pytest.fixture
def leaves_nothing_behind():
    """No namespace, link, qdisc or /etc/netns entry more after the test than before (no
    other emulated cluster of the session exists meanwhile: harness.network_lock)."""
    with harness.network_lock():
        before = system_state()
        yield
        after = system_state()
    assert after == before, f"left behind: {after} (before: {before})"


def launcher(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([*harness.FOREGROUND, sys.executable, CLUSTER_PY, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=harness.test_env(), **kwargs)


# -- without namespaces: specs and the environment each rank gets -------------------------

def test_rates_and_delays_parse_like_tc():
    assert shaping.parse_rate("1gbit") == 10**9
    assert shaping.parse_rate("100mbit") == 10**8
    assert shaping.parse_rate("2.5gbit") == 25 * 10**8
    assert shaping.parse_time("0.1ms") == pytest.approx(1e-4)
    for bad in ("1gbps", "fast", "-1mbit", "0bit"):
        with pytest.raises(cluster.ClusterError, match="bad rate"):
            shaping.parse_rate(bad)
    with pytest.raises(cluster.ClusterError, match="bad delay"):
        cluster.LinkSpec(delay="soon")
    with pytest.raises(cluster.ClusterError, match="bad loss"):
        cluster.LinkSpec(loss="0.1")
    with pytest.raises(cluster.ClusterError, match="nodes"):
        cluster.Cluster(0)


def test_bad_command_line_fails_with_a_reason():
    proc = subprocess.run([sys.executable, CLUSTER_PY, "--rate", "1gbps", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "bad rate '1gbps'" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, CLUSTER_PY], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "give a command after --" in proc.stderr, proc.stderr


def test_the_command_line_is_the_same_in_process(capsys):
    """cli.main, which `python -m hvdx.runner` runs, gives the file's answers."""
    assert cli.main(["--rate", "1gbps", "--", "true"]) == 2
    assert "hvdx-cluster: bad rate '1gbps'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2 and "give a command after --" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["--elastic", "--", "true"])
    assert info.value.code == 2 and "--elastic needs --host-discovery-script" in capsys.readouterr().err


def test_the_launcher_starts_without_tensorflow():
    """Run as a file, the launcher loads hvdx.runner and the lazy hvdx package, not TensorFlow
    nor Horovod's TensorFlow half: a launcher that only starts processes costs no seconds and
    no ~400 MB of them."""
    proc = subprocess.run([sys.executable, "-X", "importtime", CLUSTER_PY, "--help"], capture_output=True,
                          text=True, timeout=60, env=harness.test_env())
    assert proc.returncode == 0 and "--ranks-per-node" in proc.stdout, proc.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert {"hvdx.runner.cli", "hvdx.runner.cluster", "hvdx.runner.launch"} <= imported
    assert not {"tensorflow", "horovod.tensorflow", "hvdx.ops", "hvdx.comm"} & imported


def test_every_rank_gets_horovodruns_environment():
    envs, plan = cluster.rank_environments(cluster.Cluster(3), ranks_per_node=2, rendezvous_port=1234)
    assert [int(e["HOROVOD_RANK"]) for e in envs] == list(range(6))
    for rank, env in enumerate(envs):
        node, local = divmod(rank, 2)
        assert env["HOROVOD_HOSTNAME"] == f"node{node}"
        assert (env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"]) == (str(local), "2")
        assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == (str(node), "3")
        assert env["HOROVOD_SIZE"] == "6" and env["HOROVOD_GLOO_IFACE"] == "eth0"
        assert (env["HOROVOD_GLOO_RENDEZVOUS_ADDR"], env["HOROVOD_GLOO_RENDEZVOUS_PORT"]) == ("10.77.0.254", "1234")
        assert json.loads(env["HVDX_CLUSTER"])["ranks_per_node"] == 2
    assert len(plan) == 6


def test_a_relaunch_on_the_nodes_left_places_ranks_there_only():
    envs, plan = cluster.rank_environments(cluster.Cluster(3), ranks_per_node=2, rendezvous_port=1, nodes=[2])
    assert [(e["HOROVOD_RANK"], e["HOROVOD_HOSTNAME"], e["HOROVOD_SIZE"]) for e in envs] == [
        ("0", "node2", "2"), ("1", "node2", "2")]


def test_pinned_nodes_split_the_cores_and_wrap_their_commands():
    import os

    cores = sorted(os.sched_getaffinity(0))
    pinned = cluster.Cluster(2, pin_cores=True)
    shares = [pinned.node_cpus(i) for i in range(2)]
    if len(cores) >= 2:
        assert set(",".join(shares).split(",")) <= {str(c) for c in cores} and shares[0] != shares[1]
    assert pinned.command(1, ["python"])[:3] == ["taskset", "-c", shares[1]]
    assert cluster.Cluster(2).node_cpus(0) is None and cluster.Cluster(2).command(0, ["x"])[0] == "ip"


# -- with namespaces -------------------------------------------------------------------------

@needs_namespaces
@pytest.mark.multirank
def test_two_by_two_job_sees_a_real_topology(leaves_nothing_behind):
    job = harness.launch_on_cluster("check_cluster.py", "--nodes", "2", "--ranks-per-node", "2",
                                    nodes=2, ranks_per_node=2, rate="1gbit", timeout=180)
    data = job.check()
    assert [data[r]["address"] for r in range(4)] == ["10.77.0.1", "10.77.0.1", "10.77.0.2", "10.77.0.2"]
    assert data[0]["cluster"]["rate_bps"] == 10**9
    for rank in range(4):  # every rank's output, prefixed with its rank as horovodrun does
        assert f"[{rank}]<stdout>:rank {rank} on node{rank // 2}" in job.output, job.output[-3000:]


@needs_namespaces
def test_links_run_at_the_configured_rate_and_nodes_inside_are_fast(leaves_nothing_behind):
    rate = 200 * 10**6

    def best(c, src, dst, nbytes, tries=3):
        """The fastest of up to `tries` transfers: the link caps every one, and a transfer
        whose ends lost their cores to the rest of the suite (running beside this test) is
        slower than the link, not a measurement of it (CI on tf2.15: 63 Mbit/s one way once)."""
        speeds = []
        for _ in range(tries):
            speeds.append(probe.throughput(c, src, dst, nbytes=nbytes))
            if speeds[-1] >= 0.8 * rate:
                break
        return max(speeds)

    with cluster.Cluster(2, cluster.LinkSpec(rate="200mbit", delay=None)) as c:
        there = best(c, 0, 1, 8 << 20)
        back = best(c, 1, 0, 8 << 20)
        inside = probe.throughput(c, 0, 0, nbytes=64 << 20)
    for measured in (there, back):
        assert 0.8 * rate <= measured <= 1.2 * rate, (there, back)
    assert inside > 5 * max(there, back), (inside, there, back)


@needs_namespaces
def test_a_failing_rank_stops_the_job_and_everything_is_removed(leaves_nothing_behind, tmp_path):
    # Every rank says it is up (a file each: namespaces share the file system); rank 1 fails
    # only once all four are up, so the job's output holds every rank's line.
    script = ("import os, sys, time, pathlib; r = int(os.environ['HOROVOD_RANK']); d = pathlib.Path(sys.argv[1]); "
              "print('up', r, flush=True); (d / f'up{r}').touch(); "
              "t = time.monotonic() + 60\n"
              "while r == 1 and len(list(d.glob('up*'))) < 4 and time.monotonic() < t: time.sleep(0.05)\n"
              "sys.exit(3) if r == 1 else time.sleep(120)")
    start = time.monotonic()
    proc = launcher("--nodes", "2", "--ranks-per-node", "2", "--", sys.executable, "-c", script, str(tmp_path))
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, output
    assert "rank 1 (node 0) exited with status 3; stopping the other ranks" in output, output
    assert all(f"[{r}]<stdout>:up {r}" in output for r in range(4)), output
    assert time.monotonic() - start < 60  # the sleeping ranks were killed, not waited for


def test_a_horovodrun_job_needs_nodes_of_the_cluster():
    with pytest.raises(cluster.ClusterError, match="nodes among 0..1"):
        cluster.run_horovodrun_job(cluster.Cluster(2), 2, ["true"], nodes=[2])
    with pytest.raises(cluster.ClusterError, match="ranks_per_node >= 1"):
        cluster.run_horovodrun_job(cluster.Cluster(2), 0, ["true"])


@needs_namespaces
@pytest.mark.multirank
def test_a_horovodrun_job_relaunched_on_the_node_left_runs_there_only(leaves_nothing_behind, tmp_path):
    """A fixed-size job as a user launches one (horovodrun -np 2 -H node1:2, its ssh the UTS
    agent): both ranks on node1, in its network namespace, a world of 2."""
    import io

    script = ("import os, socket, subprocess; address = subprocess.run(['ip', '-o', '-4', 'addr', 'show', 'eth0'], "
              "capture_output=True, text=True).stdout.split()[3]; print('rank', os.environ['HOROVOD_RANK'], 'of', "
              "os.environ['HOROVOD_SIZE'], 'on', socket.gethostname(), address, flush=True)")
    out = io.StringIO()
    with cluster.Cluster(2) as c:
        code = cluster.run_horovodrun_job(c, 2, [sys.executable, "-c", script], nodes=[1], timeout=120, out=out,
                                          env=harness.test_env(str(tmp_path)))
    output = out.getvalue()
    assert code == 0, output[-3000:]
    lines = sorted(line.split("<stdout>:", 1)[1] for line in output.splitlines() if "<stdout>:rank" in line)
    assert lines == ["rank 0 of 2 on node1 10.77.0.2/24", "rank 1 of 2 on node1 10.77.0.2/24"], output[-3000:]


@needs_namespaces
def test_a_job_past_its_timeout_is_killed(leaves_nothing_behind):
    proc = launcher("--nodes", "2", "--ranks-per-node", "1", "--timeout", "2", "--", "sleep", "120")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 124 and "timed out after 2 s; rank(s) [0, 1] still running" in output, output


@needs_namespaces
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupting_the_launcher_removes_everything(sig, leaves_nothing_behind):
    before = set(netns.namespaces())
    proc = launcher("--nodes", "2", "--ranks-per-node", "1", "--", "sleep", "120")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(set(netns.namespaces()) - before) < 3:
        time.sleep(0.1)
    assert len(set(netns.namespaces()) - before) == 3, "the cluster never came up"
    time.sleep(1)  # the ranks are starting
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode in (130, 128 + sig), output


@needs_namespaces
def test_cleanup_removes_what_a_killed_launcher_left(leaves_nothing_behind):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"hvdx-{dead.pid}-1-n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        proc = subprocess.run([sys.executable, CLUSTER_PY, "--cleanup"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and stale in proc.stdout, proc.stdout + proc.stderr
        assert stale not in netns.namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
