"""Emulated cloud cluster: nodes as network namespaces joined by rate-shaped links.

Runs a Horovod job across nodes emulated on one machine (docs/cluster.md), as horovodrun
would, without ssh (needs root):

    python -m hvdx.runner --nodes 2 --ranks-per-node 2 --rate 1gbit -- python benchmarks/comm.py
    python hvdx/runner/cluster.py --nodes 2 --rate 1gbit --probe     # the same command line
    python -m hvdx.runner --cleanup                                  # what a killed launcher left

Layout (every address exists only inside namespaces this launcher creates and removes):

    hvdx-<pid>-<k>-sw   "switch": bridge eth0 (10.77.0.254/24), one port p<i> per node
    hvdx-<pid>-<k>-n<i> node i: eth0 = 10.77.0.<i+1>/24, the far end of a veth pair from p<i>

Both ends of each veth pair are shaped to `rate` (hvdx/runner/shaping.py): every node has a
full-duplex NIC of that rate on a non-blocking switch; ranks of one node talk over their
namespace's loopback, unshaped. Delay and loss need netem; where the kernel lacks it they are
left out with a warning, and $HVDX_CLUSTER says `"delay_applied": false`. With `pin_cores`
(`--pin-cores`) each node's processes run on their own share of this machine's cores, so that
a node that leaves takes its compute with it.

Each rank gets horovodrun's Gloo environment (rank r on node r // ranks_per_node,
HOROVOD_HOSTNAME=node<i>, HOROVOD_GLOO_IFACE=eth0, Horovod's rendezvous server listening in
the switch namespace) and HVDX_CLUSTER, the network's JSON description. Output lines are
prefixed `[rank]<stdout>:` / `[rank]<stderr>:` like horovodrun's. The job ends with the exit
status of the first failing rank (the others are killed then), or 124 on timeout; everything
created is removed, also on error, SIGTERM and Ctrl-C.

`run_elastic_job` runs an elastic job instead (`--elastic`): horovodrun itself, in the switch
namespace, with a host-discovery script that names nodes (`node0:2`), and as its ssh an agent
that starts a node's workers in that node's namespace (uts_agent.sh); `Cluster.kill_node`
preempts a node (SIGKILLs everything in it). `run_horovodrun_job` runs a fixed-size job under
horovodrun the same way (a user's launch, with horovodrun's start-up: a relaunch measured as a
user pays it).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # `python hvdx/runner/cluster.py ...` (as the tests and benchmarks run it) and
    # `python -m hvdx.runner.cluster ...` are `python -m hvdx.runner ...` (cli.py). Run as a
    # file, the folder that holds hvdx takes this folder's place on sys.path; `import hvdx`
    # imports no TensorFlow (the package is lazy), so the launcher starts in a fraction of a second.
    import runpy

    if not __package__:
        sys.path[0] = str(Path(__file__).resolve().parents[2])
    sys.exit(runpy.run_module("hvdx.runner", run_name="__main__", alter_sys=True))

import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import IO, Dict, List, Optional, Sequence, Tuple  # noqa: E402

from .launch import run_ranks  # noqa: E402
from .netns import (ClusterError, add_bridge, add_namespace, add_port, cleanup_stale, delete_namespace,  # noqa: E402
                    in_namespace, kill_all, write_hosts)
from .shaping import LinkSpec, netem_available, shape  # noqa: E402

__all__ = ["Cluster", "ClusterError", "LinkSpec", "rank_environments", "run_elastic_job", "run_horovodrun_job",
           "run_job", "run_mpi_job"]

DESCRIPTION = __doc__.split("\n\n")[0]

SUBNET = "10.77.0"
SWITCH_ADDR = f"{SUBNET}.254"
NODE_IFACE = "eth0"
#: The switch's bridge has the nodes' interface name: horovodrun's elastic driver, which runs
#: in the switch, looks its own address up on the interface the workers share.
SWITCH_IFACE = NODE_IFACE
_counter = 0


@dataclass
class Cluster:
    """`nodes` namespaces behind one switch namespace; a context manager that removes them all.

    >>> with Cluster(2, LinkSpec(rate="1gbit")) as c:
    ...     run_job(c, 2, ["python", "train.py"])

    Raises:
        ClusterError: nodes outside 1..250; on entering, no root or a failed ip/tc command.
    """

    nodes: int
    link: LinkSpec = field(default_factory=LinkSpec)
    pin_cores: bool = False
    delay_applied: bool = False
    created: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        global _counter
        if not 1 <= self.nodes <= 250:
            raise ClusterError(f"nodes must be in 1..250, got {self.nodes}")
        _counter += 1
        self.prefix = f"hvdx-{os.getpid()}-{_counter}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def node_namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @staticmethod
    def node_address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @staticmethod
    def node_hostname(node: int) -> str:
        return f"node{node}"

    def node_cpus(self, node: int) -> Optional[str]:
        """The cores node `node` runs on (taskset's list), None unless `pin_cores`: this
        machine's cores split evenly, one core shared by several nodes when they outnumber them."""
        if not self.pin_cores:
            return None
        cores = sorted(os.sched_getaffinity(0))
        if self.nodes >= len(cores):
            return str(cores[node % len(cores)])
        share = len(cores) // self.nodes
        return ",".join(str(c) for c in cores[node * share:(node + 1) * share])

    def kill_node(self, node: int) -> int:
        """Preempts node `node`: SIGKILLs every process in its namespace (its links stay);
        returns how many were killed."""
        return kill_all(self.node_namespace(node))

    def describe(self) -> dict:
        """What HVDX_CLUSTER tells the ranks (and benchmarks write next to their results)."""
        return {"nodes": self.nodes, "rate": self.link.rate, "rate_bps": self.link.rate_bps,
                "delay": self.link.delay if self.delay_applied else None,
                "loss": self.link.loss if self.delay_applied else None,
                "delay_applied": self.delay_applied, "delay_requested": self.link.delay,
                "mtu": self.link.mtu, "qdisc": "netem+tbf" if self.delay_applied else "tbf",
                "cpus": [self.node_cpus(i) for i in range(self.nodes)] if self.pin_cores else None}

    def __enter__(self) -> "Cluster":
        if os.geteuid() != 0:
            raise ClusterError("the emulated cluster needs root (network namespaces, tc)")
        cleanup_stale()
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _add_namespace(self, ns: str) -> None:
        self.created.append(ns)  # first: destroy() removes it even if making it fails halfway
        add_namespace(ns)

    def _build(self) -> None:
        self._add_namespace(self.switch)
        add_bridge(self.switch, SWITCH_IFACE, f"{SWITCH_ADDR}/24")
        self.delay_applied = self.link.wants_netem() and netem_available(self.switch)
        if self.link.wants_netem() and not self.delay_applied:
            print(f"hvdx-cluster: warning: this kernel has no netem qdisc, so delay {self.link.delay}"
                  f"{' and loss ' + self.link.loss if self.link.loss else ''} cannot be emulated; "
                  f"links are rate-shaped only ({self.link.rate})", file=sys.stderr, flush=True)
        for node in range(self.nodes):
            ns, port = self.node_namespace(node), f"p{node}"
            self._add_namespace(ns)
            add_port(self.switch, SWITCH_IFACE, port, ns, NODE_IFACE, f"{self.node_address(node)}/24", self.link.mtu)
            shape(ns, NODE_IFACE, self.link, netem=self.delay_applied)    # the NIC's transmit side
            shape(self.switch, port, self.link, netem=self.delay_applied)  # the NIC's receive side
            write_hosts(ns, self._hosts(node))
        write_hosts(self.switch, [f"{self.node_address(j)} {self.node_hostname(j)}" for j in range(self.nodes)]
                    + ["127.0.0.1 localhost", f"{SWITCH_ADDR} switch"])

    def _hosts(self, node: int) -> List[str]:
        """The node's /etc/hosts: this machine's host name is the node's own address there.

        Horovod 0.28 creates the Gloo devices of process sets without HOROVOD_GLOO_IFACE,
        from the address the host name resolves to; on a real cluster that is the node's
        NIC, and here it must be too (the machine's /etc/hosts maps it to 127.0.0.1).
        """
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 f"{self.node_address(node)} {socket.gethostname()} {self.node_hostname(node)}",
                 f"{SWITCH_ADDR} switch"]
        return lines + [f"{self.node_address(j)} {self.node_hostname(j)}" for j in range(self.nodes) if j != node]

    def destroy(self) -> None:
        """Kills anything left in the namespaces and deletes them; safe to call twice."""
        while self.created:
            delete_namespace(self.created.pop())

    def command(self, node: int, argv: Sequence[str]) -> List[str]:
        """`argv` wrapped to run inside node `node`'s namespace (on its cores with `pin_cores`)."""
        cpus = self.node_cpus(node)
        return [*(["taskset", "-c", cpus] if cpus else []), "ip", "netns", "exec", self.node_namespace(node), *argv]


def rank_environments(cluster: Cluster, ranks_per_node: int, rendezvous_port: int,
                      nodes: Optional[Sequence[int]] = None) -> Tuple[List[Dict[str, str]], list]:
    """horovodrun's Gloo environment for every rank, placed node by node (rank r on the
    (r // n)-th of `nodes`, default every node), and Horovod's slot plan for the rendezvous server."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    nodes = list(range(cluster.nodes)) if nodes is None else list(nodes)
    hosts = ",".join(f"{cluster.node_hostname(i)}:{ranks_per_node}" for i in nodes)
    plan = get_host_assignments(parse_hosts(hosts), len(nodes) * ranks_per_node)
    description = json.dumps(dict(cluster.describe(), ranks_per_node=ranks_per_node))
    envs = []
    for slot in plan:
        envs.append({
            "HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
            "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
            "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": SWITCH_ADDR, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": NODE_IFACE, "NCCL_SOCKET_IFNAME": NODE_IFACE,
            "HVDX_CLUSTER": description, "PYTHONUNBUFFERED": "1",
        })
    return envs, plan


def run_job(cluster: Cluster, ranks_per_node: int, command: Sequence[str], *, timeout: Optional[float] = None,
            env: Optional[Dict[str, str]] = None, out: IO[str] = sys.stdout,
            nodes: Optional[Sequence[int]] = None) -> int:
    """Runs `command` as ranks_per_node ranks in every node of `cluster` (or in `nodes`: a job
    relaunched on the nodes a preemption left); 0 when every rank succeeds.

    Returns the exit status of the first rank that fails (the others are killed then), or
    124 when `timeout` seconds pass first. Says which rank on `out` (launch.run_ranks).

    Raises:
        ClusterError: ranks_per_node < 1 or an empty command.
    """
    from horovod.runner.http.http_server import RendezvousServer

    if ranks_per_node < 1:
        raise ClusterError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if not command:
        raise ClusterError("no command to run")
    server = RendezvousServer()
    with in_namespace(cluster.switch):
        port = server.start()
    try:
        envs, plan = rank_environments(cluster, ranks_per_node, port, nodes)
        server.init(plan)
        node_of = {cluster.node_hostname(i): i for i in range(cluster.nodes)}
        commands = [cluster.command(node_of[e["HOROVOD_HOSTNAME"]], command) for e in envs]
        return run_ranks(commands, [{**os.environ, **(env or {}), **e} for e in envs], ranks_per_node=ranks_per_node,
                         timeout=timeout, out=out, name="hvdx-cluster")
    finally:
        server.stop()


def _agent_env(cluster: Cluster, ranks_per_node: int) -> Dict[str, str]:
    """What uts_agent.sh (mpirun's rsh agent, horovodrun's ssh) needs to start a node's
    processes in its namespace (HVDX_NETNS_MAP) and on its cores (HVDX_CPU_MAP, with
    `pin_cores`), and what the ranks are told of the network (HVDX_CLUSTER)."""
    names = [cluster.node_hostname(i) for i in range(cluster.nodes)]
    return {"HVDX_NETNS_MAP": " ".join(f"{name}:{cluster.node_namespace(i)}" for i, name in enumerate(names)),
            "HVDX_CPU_MAP": " ".join(f"{name}:{cluster.node_cpus(i)}" for i, name in enumerate(names)
                                     if cluster.pin_cores),
            "HVDX_CLUSTER": json.dumps(dict(cluster.describe(), ranks_per_node=ranks_per_node)),
            "PYTHONUNBUFFERED": "1"}


def _exit_status(job, timeout: Optional[float], out: Optional[IO[str]]) -> int:
    """A launcher's exit status (124 past `timeout`), its output written to `out` (None: nowhere)."""
    if out is not None:
        out.write(job.output or "")
        if job.timed_out:
            print(f"hvdx-cluster: timed out after {timeout:g} s", file=out, flush=True)
    return 124 if job.timed_out else job.returncode


def run_elastic_job(cluster: Cluster, ranks_per_node: int, command: Sequence[str], *, discovery_script: str,
                    min_np: int, max_np: Optional[int] = None, np: Optional[int] = None,
                    timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
                    out: Optional[IO[str]] = sys.stdout, horovodrun_args: Sequence[str] = ()) -> int:
    """Runs `command` as an elastic Horovod job on `cluster`, as a user runs one on a cloud:

        horovodrun --gloo -np NP --min-np MIN --max-np MAX --host-discovery-script SCRIPT
                   --network-interface eth0 COMMAND...

    horovodrun (its elastic driver and rendezvous) runs in the switch namespace; it starts a
    node's workers over "ssh", here uts_agent.sh: in that node's namespace, under its host name
    (and on its cores with `pin_cores`). The discovery script runs in the switch too and prints
    the nodes that are up as `node<i>:<slots>` lines (a script whose list a test or benchmark
    changes); a node that leaves is removed from it, and, if preempted, `cluster.kill_node(i)`.

    Args:
        np: ranks to start with (default: every node's ranks_per_node).
        max_np: default nodes x ranks_per_node.
        out: where horovodrun's output goes when it ends (None: nowhere).
        horovodrun_args: more of horovodrun's options, e.g. ("--blacklist-cooldown-range", "1", "10"):
            without it a node whose workers were killed never rejoins (Horovod blacklists it).

    Returns:
        horovodrun's exit status, 124 when `timeout` seconds pass first.

    Raises:
        ClusterError: ranks_per_node < 1, an empty command or min_np outside 1..max_np.
    """
    total = cluster.nodes * ranks_per_node
    max_np = max_np or total
    if ranks_per_node < 1 or not command or not 1 <= min_np <= max_np:
        raise ClusterError(f"need ranks_per_node >= 1, a command and 1 <= min_np <= max_np, got {ranks_per_node}, "
                           f"{list(command)}, min_np={min_np}, max_np={max_np}")
    return _horovodrun(cluster, ranks_per_node, ["-np", str(np or total), "--min-np", str(min_np), "--max-np",
                                                 str(max_np), "--host-discovery-script", discovery_script,
                                                 *horovodrun_args], command, timeout, env, out)


def run_horovodrun_job(cluster: Cluster, ranks_per_node: int, command: Sequence[str], *,
                       nodes: Optional[Sequence[int]] = None, timeout: Optional[float] = None,
                       env: Optional[Dict[str, str]] = None, out: Optional[IO[str]] = sys.stdout) -> int:
    """Runs `command` as a fixed-size Horovod job on `cluster` (or on `nodes`: a job
    relaunched on the nodes a preemption left) under horovodrun, as a user launches one:

        horovodrun --gloo -np N -H node0:R,node1:R --network-interface eth0 COMMAND...

    run_job starts the same ranks without horovodrun (hvdx's launcher: no Gloo build check,
    no ssh, so it starts sooner); this is the launch a user's job pays. As in
    run_elastic_job, horovodrun runs in the switch namespace and starts each node's ranks
    over uts_agent.sh as its "ssh".

    Returns:
        horovodrun's exit status, 124 when `timeout` seconds pass first.

    Raises:
        ClusterError: ranks_per_node < 1, an empty command, or a node index outside the cluster.
    """
    nodes = list(range(cluster.nodes)) if nodes is None else list(nodes)
    if ranks_per_node < 1 or not command or not nodes or not all(0 <= i < cluster.nodes for i in nodes):
        raise ClusterError(f"need ranks_per_node >= 1, a command and nodes among 0..{cluster.nodes - 1}, got "
                           f"{ranks_per_node}, {list(command)}, nodes={nodes}")
    hosts = ",".join(f"{cluster.node_hostname(i)}:{ranks_per_node}" for i in nodes)
    return _horovodrun(cluster, ranks_per_node, ["-np", str(len(nodes) * ranks_per_node), "-H", hosts], command,
                       timeout, env, out)


def _horovodrun(cluster: Cluster, ranks_per_node: int, options: Sequence[str], command: Sequence[str],
                timeout: Optional[float], env: Optional[Dict[str, str]], out: Optional[IO[str]]) -> int:
    """`horovodrun --gloo OPTIONS --network-interface eth0 COMMAND` in the switch namespace,
    uts_agent.sh as its ssh; its exit status (124 past `timeout`)."""
    import tempfile

    from .launch import HOROVODRUN, run
    from .mpi import AGENT

    with tempfile.TemporaryDirectory(prefix="hvdx-horovodrun-") as folder:
        os.symlink(AGENT, os.path.join(folder, "ssh"))  # horovodrun's `ssh HOST COMMAND`
        horovodrun = [str(HOROVODRUN), "--gloo", *options, "--network-interface", NODE_IFACE, *command]
        job = run(["ip", "netns", "exec", cluster.switch, *horovodrun], timeout=timeout,
                  env={**os.environ, **(env or {}), **_agent_env(cluster, ranks_per_node),
                       "PATH": folder + os.pathsep + os.environ.get("PATH", "")})
    return _exit_status(job, timeout, out)


def run_mpi_job(cluster: Cluster, ranks_per_node: int, command: Sequence[str], *, timeout: Optional[float] = None,
                env: Optional[Dict[str, str]] = None, out: IO[str] = sys.stdout) -> int:
    """Runs `command` under mpirun as ranks_per_node ranks on every node of `cluster`, as
    run_job does under Horovod's Gloo: mpirun in the switch namespace, Open MPI's daemon of
    node i started by hvdx/runner/uts_agent.sh in node i's network namespace and in a UTS
    namespace named node<i>, Open MPI's TCP traffic between nodes on the nodes' shaped links
    (the ranks of one node talk over shared memory). Output lines are mpirun's
    (`[job,rank]<stdout>:`); returns mpirun's exit status, 124 on timeout.

    Raises:
        ClusterError: ranks_per_node < 1, an empty command, or no Open MPI (hvdx.runner.mpi).
    """
    import tempfile

    from .launch import run
    from .mpi import AGENT, OVERSUBSCRIBED_MCA, mpi_unavailable, mpirun_command

    if ranks_per_node < 1 or not command:
        raise ClusterError(f"need ranks_per_node >= 1 and a command, got {ranks_per_node}, {list(command)}")
    why = mpi_unavailable()
    if why:
        raise ClusterError(why)
    np = cluster.nodes * ranks_per_node
    subnet = f"{SUBNET}.0/24"
    mca = {"btl_tcp_if_include": subnet, "oob_tcp_if_include": subnet}
    if np > (os.cpu_count() or 1):
        mca.update(OVERSUBSCRIBED_MCA)  # the nodes share this machine's cores (docs/launching.md)
    names = [cluster.node_hostname(i) for i in range(cluster.nodes)]
    with tempfile.TemporaryDirectory(prefix="hvdx-mpi-") as folder:
        hostfile = os.path.join(folder, "hostfile")
        with open(hostfile, "w") as f:
            f.write("".join(f"{name} slots={ranks_per_node}\n" for name in names))
        mpirun = mpirun_command(command, np=np, hostfile=hostfile, agent=AGENT, bind_to="none", mca=mca,
                                forward=("PATH", "PYTHONPATH", "HVDX_CLUSTER"))
        job = run(["ip", "netns", "exec", cluster.switch, *mpirun], timeout=timeout,
                  env={**os.environ, **(env or {}), **_agent_env(cluster, ranks_per_node)})
    return _exit_status(job, timeout, out)
